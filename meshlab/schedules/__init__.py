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
from meshlab.schedules.builders import BUILDERS, build
from meshlab.schedules.simulate import Costs, Timeline

__all__ = ["BUILDERS", "Action", "Costs", "Schedule", "ScheduleError", "Timeline", "build",
           "contiguous", "looped", "parse", "vshape"]
