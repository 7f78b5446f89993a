"""ipyparallel's engine as mpiexec starts it for the mpi profile, without MPI.

ipyparallel's MPI launcher appends ``--mpi``, which makes every engine import mpi4py and
initialise MPI only to take its MPI rank as engine id. meshlab numbers ranks by host itself
and its process group is torch.distributed, so the engines stay plain processes: no mpi4py
to install, no MPI sockets. A cell may still import mpi4py and initialise MPI.
"""

import sys

from ipyparallel.engine.app import main

if __name__ == "__main__":
    sys.argv = [arg for arg in sys.argv if arg != "--mpi"]
    main()
