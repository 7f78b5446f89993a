"""Replica modes: replicas that train apart and meet now and then (local SGD, DiLoCo, EDiT,
A-EDiT, a parameter server), each with its one-process reference. They import the
strategies (meshlab.parallel); meshlab.parallel reaches them only through its registry
(meshlab.parallel.replica_modes)."""
