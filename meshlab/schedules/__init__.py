"""Pipeline schedules as data: build, parse, validate, simulate, and execute step by step.

``build("1f1b", ranks=4, microbatches=8)`` or ``parse(text)`` give a Schedule;
``schedule.validate()`` raises ScheduleError with the grid at the fault;
``schedule.simulate(Costs(...))`` gives a Timeline (makespan, bubble fraction, in-flight
micro-batches). Engine side: pure Python here, torch only in execute.py.
"""

from __future__ import annotations

from meshlab.schedules.actions import (
    Action,
    Schedule,
    ScheduleError,
    contiguous,
    looped,
    parse,
    vshape,
)
from meshlab.schedules.builders import (
    BREADTH_FIRST,
    BUILDERS,
    SPLIT_BACKWARD,
    TAKES_VIRTUAL,
    V_SHAPED,
    build,
    canonical,
    check_virtual,
    stages_per_rank,
)
from meshlab.schedules.simulate import Costs, Timeline

__all__ = ["BREADTH_FIRST", "BUILDERS", "SPLIT_BACKWARD", "TAKES_VIRTUAL", "V_SHAPED",
           "Action", "Costs", "Schedule", "ScheduleError", "Timeline", "build", "canonical",
           "check_virtual", "contiguous", "looped", "parse", "stages_per_rank", "vshape"]
