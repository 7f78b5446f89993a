"""A rank's own machinery: how an engine runs cells and answers the notebook (cell server,
executor, wire, probes, network, private files). Imported by meshlab.runtime and by the
notebook side's functions that run on ranks; imports no parallelism, dry run or planner."""
