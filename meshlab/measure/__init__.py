"""What a rank measures and reports: shards, collectives, memory, profiles, timing loops, a
straggler made on purpose, all-reduce algorithms. Plain torch; imported by the strategies,
the dry run, calibration and the notebook side; imports no parallelism."""
