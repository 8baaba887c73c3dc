"""An alpha-beta cost model of tensor-parallel prefill with each AllReduce method.

Per AllReduce:  t_comm = alpha x messages + beta x bytes on the medium (+ the method's
quantization compute, measured, not modelled). Per prefill:

    T(method, link) = T_nolink(method) + n_allreduce x t_comm(method, message, link)

where T_nolink is the same program measured in one process with virtual devices (there a
collective is a memcpy, so that time is the model's compute plus the quantization compute of
the method) and the link is described by three numbers fitted from collective-only
measurements (`fit_link`):
  alpha         seconds per message each device sends (collective-permute, or psum step),
  efficiency    achieved fraction of the nominal link rate for the ring's traffic,
  psum_penalty  extra factor on the bytes of XLA's own bf16 psum. On gloo bfloat16 moves at
                about half the bytes/s of other dtypes; on TPU this factor is 1.

`shared=True` describes the shaped loopback used for emulation: every device's bytes go through
one token bucket, so the medium carries N x bytes_per_device. A TPU ring has its own links per
device (`shared=False`).

The same model with TPU v5e published figures (`TPU_V5E`) predicts the paper's Gemma 3 prefill
configurations; those are predictions, and the assumptions they rest on are printed with them.

One module per job: `schedule` (the byte model: what each method sends), `link` (the link model
and its fit), `prefill` (prefill predictions on a fitted link), `tpu` (TPU v5e figures and the
paper's configurations), `topology` (the link-level simulator of TPU slices), `emulated` (checks
against the emulated torus) and `__main__` (the CLI). The ring's hop counts and the v5e link come
from equarx (`equarx.ring.ring_hops`, `equarx.schedule.V5E_LINK_BYTES_PER_S`).
"""
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
