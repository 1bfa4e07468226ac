"""Pipeline parallelism: schedules as data (GPipe, 1F1B, interleaved, Hanayo waves).

Placeholder docstring; replaced below when the executor lands.
"""

from .analysis import Message, ScheduleError, SimResult, bubble_formula, message_plan, simulate, validate
from .checks import check_pipeline_args, check_schedule_name, num_chunks, pipeline_arg_problems
from .plot import plot
from .schedule import (
    SCHEDULES, Action, Schedule, gpipe, hanayo, interleaved_1f1b, linear_placement, list_schedule,
    looped_placement, make_schedule, one_f_one_b, wave_placement, wave_rank,
)

__all__ = [
    "Action", "Schedule", "ScheduleError", "SimResult", "Message", "SCHEDULES",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "hanayo", "make_schedule", "list_schedule",
    "linear_placement", "looped_placement", "wave_placement", "wave_rank",
    "validate", "simulate", "bubble_formula", "message_plan", "plot",
    "check_pipeline_args", "check_schedule_name", "num_chunks", "pipeline_arg_problems",
]
