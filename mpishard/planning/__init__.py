"""Layout planning: machine descriptions, a step-time cost model, and a search over layouts.

    from mpishard.planning import load_machine, predict_step, rank_layouts

See [Note: step-time model] in cost.py and docs/planning.md.
"""
from mpishard.planning.cost import StepCost, predict_step, stage_flops
from mpishard.planning.machine import Link, Machine
from mpishard.planning.machine_file import (load_machine, machine_from_dict,
                                           merge_calibrations, shipped_machines)
from mpishard.planning.search import Ranked, candidate_layouts, format_table, rank_layouts

__all__ = ["StepCost", "predict_step", "stage_flops", "Link", "Machine",
           "load_machine", "machine_from_dict", "merge_calibrations", "shipped_machines",
           "Ranked", "candidate_layouts", "format_table", "rank_layouts"]
