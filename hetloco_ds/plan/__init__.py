"""Cost model (`hetloco-ds plan`): how long an inner step and an outer sync take on given links
and devices, and which groups of a heterogeneous fleet should compress, and how much.

Pure Python (no torch), so it runs anywhere and is testable on its own. By job:

    shapes.py  model shapes: ModelShape, the presets, the parameter tensors of each stage and block
    model.py   byte and time model: Settings, predict (exact bytes from hetloco_ds.sizes)
    outer_step.py  one outer step of replicas with their own S and links: the exchange by block,
                   who waits for whom (predict_outer_step)
    memory.py  device memory per stage (`sizes`' rules), the largest preset per GPU count and memory
    fleet.py   the fleet planner: plan_fleet
    cli.py     `hetloco-ds plan`: argument parsing and the printed tables
"""
from .cli import format_fleet, format_outer_step, format_prediction, main
from .fleet import DEFAULT_RATIOS, DeviceGroup, FleetPlan, GroupPlan, fleet_config, load_fleet, plan_fleet
from .memory import Largest, format_largest, largest_preset, largest_table, min_stages, stage_memory_bytes
from .model import TERMS, Prediction, Settings, explain, outer_payload_bytes, parse_rate, predict, simulate_schedule
from .outer_step import OuterStep, ReplicaStep, exchange_times, predict_outer_step, replica_blocks
from .shapes import PRESETS, ModelShape, block_tensors, resolve_model, stage_tensors

__all__ = ["DEFAULT_RATIOS", "DeviceGroup", "FleetPlan", "GroupPlan", "Largest", "ModelShape", "OuterStep", "PRESETS", "Prediction",
           "ReplicaStep", "Settings", "TERMS", "block_tensors", "exchange_times", "explain", "fleet_config",
           "format_fleet", "format_largest", "format_outer_step", "format_prediction", "largest_preset", "largest_table", "load_fleet", "main", "min_stages",
           "outer_payload_bytes", "parse_rate", "plan_fleet", "predict", "predict_outer_step", "replica_blocks",
           "resolve_model", "simulate_schedule", "stage_memory_bytes", "stage_tensors"]
