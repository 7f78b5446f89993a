"""ray_job.py written from a journal's layout: the exported script on a Ray cluster, as
job.sbatch runs it on Slurm: one torchrun per node, each on a bundle of a placement group
that spreads them one to a node, rendezvous on the first node."""

from __future__ import annotations

TEMPLATE = '''"""Exported by meshlab: {train} on a Ray cluster, {nodes} node(s) x {per_node}
process(es) each.

A placement group holds one bundle per node (STRICT_SPREAD: a node each); on each an actor
runs torchrun for that node, the first node's address the rendezvous. Nothing of Ray's
training libraries: the script is the one launch.sh and job.sbatch run. This folder goes
to every node as the job's working_dir. Run it where the cluster is reachable:

    python {job}                                  # on a node of the cluster ("auto")
    RAY_ADDRESS=ray://HEAD:10001 python {job}     # through Ray Client (KubeRay's head)

Every node needs this Python (PYTHON overrides it) with torch and meshlab installed.
"""

import os
import subprocess
import sys

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

NODES, PER_NODE, GPUS, PORT = {nodes}, {per_node}, {gpus}, {port}
HERE = os.path.dirname(os.path.abspath(__file__))


@ray.remote
class Node:
    def address(self):
        return ray.util.get_node_ip_address()

    def run(self, head, node_rank):
        python = os.environ.get("PYTHON", sys.executable)
        command = [python, "-m", "torch.distributed.run", "--nnodes", str(NODES),
                   "--nproc-per-node", str(PER_NODE), "--node-rank", str(node_rank),
                   "--master-addr", head, "--master-port", str(PORT), "{train}"]
        done = subprocess.run(command, capture_output=True, text=True)
        return done.returncode, done.stdout, done.stderr


def main():
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"),
             runtime_env={{"working_dir": HERE}}, log_to_driver=False)
    bundle = {{"CPU": PER_NODE, **({{"GPU": PER_NODE}} if GPUS else {{}})}}
    group = placement_group([dict(bundle) for _ in range(NODES)], strategy="STRICT_SPREAD")
    if not group.wait(600):
        sys.exit(f"Ray placed no {{NODES}} nodes of {{bundle}} within 600 s: "
                 f"{{ray.cluster_resources()}}")
    # each actor holds its node's bundle: Ray gives it the node's GPUs (CUDA_VISIBLE_DEVICES)
    nodes = [Node.options(num_cpus=PER_NODE, num_gpus=PER_NODE if GPUS else 0,
                          scheduling_strategy=PlacementGroupSchedulingStrategy(
                              group, placement_group_bundle_index=i)).remote()
             for i in range(NODES)]
    head = ray.get(nodes[0].address.remote())
    ended = ray.get([node.run.remote(head, i) for i, node in enumerate(nodes)])
    for i, (code, out, err) in enumerate(ended):
        sys.stdout.write(out)
        if code:
            sys.stderr.write(f"node {{i}} exited with status {{code}}:\\n{{err}}")
    sys.exit(max(code for code, _, _ in ended))


if __name__ == "__main__":
    main()
'''


def ray_job_script(nodes: int, per_node: int, gpus: bool, port: int, train: str = "train.py",
                   job: str = "ray_job.py") -> str:
    """ray_job.py: ``python ray_job.py`` runs ``train`` on ``nodes`` nodes of ``per_node``
    processes each (one per GPU where ``gpus``), torchrun's rendezvous on ``port``."""
    return TEMPLATE.format(train=train, job=job, nodes=nodes, per_node=per_node, gpus=gpus,
                           port=port)
