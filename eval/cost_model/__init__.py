"""An alpha-beta cost model of tensor-parallel prefill with each AllReduce method: a prefill's
time is its one-process time plus every AllReduce's modelled link time, on a link fitted from
collective-only runs or on a TPU slice's published figures (predictions, not measurements).
The model, its parts and the commands: docs/benchmarks.md#cost_model-predictions."""
from __future__ import annotations

from eval.cost_model.emulated import (base_kind, emulated_link_terms, format_emulated,
                                      predict_emulated, program_transfers)
from eval.cost_model.link import CommSample, Fit, LinkModel, fit_link, gbit_to_bytes_s
from eval.cost_model.prefill import allreduces_per_prefill, predict_prefill_s, predict_rows
from eval.cost_model.schedule import Schedule, allreduce_schedule
from eval.cost_model.topology import (INT8_WIRE_BYTES, TOPOLOGIES, TOPOLOGY_METHODS, TPU_V5P,
                                      TPU_V6E, Topology, Transfer, format_topology_predictions,
                                      multi_axis_steps, predict_topology, ring_order, ring_steps,
                                      steps_time_s, topology_allreduce_s, topology_predictions)
from eval.cost_model.tpu import (PAPER, TPU_V5E, Accelerator, format_tpu_predictions,
                                 predict_accelerator, prefill_flops, tpu_predictions)

__all__ = [
    "Accelerator", "CommSample", "Fit", "INT8_WIRE_BYTES", "LinkModel", "PAPER", "Schedule",
    "TOPOLOGIES", "TOPOLOGY_METHODS", "TPU_V5E", "TPU_V5P", "TPU_V6E", "Topology", "Transfer",
    "allreduce_schedule", "allreduces_per_prefill", "base_kind", "emulated_link_terms",
    "fit_link", "format_emulated", "format_topology_predictions", "format_tpu_predictions",
    "gbit_to_bytes_s", "multi_axis_steps", "predict_accelerator",
    "predict_emulated", "predict_prefill_s", "predict_rows", "predict_topology", "prefill_flops",
    "program_transfers", "ring_order", "ring_steps", "steps_time_s", "topology_allreduce_s",
    "topology_predictions", "tpu_predictions",
]
