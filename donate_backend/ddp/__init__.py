"""Gradients written straight into DDP's buckets under ``torch.compile`` (native path).

Modules, one stage each:

- ``integration``: the three entry points the native path calls (``capture``
  at the dynamo level, ``ModuleBinding.reconcile`` before every DDP forward,
  ``prepare`` for every aot graph) and the per-module binding;
- ``eligibility``: whether a module or parameter may use the buckets, and why not;
- ``parameters``: which graph inputs and backward outputs are which parameters (pure);
- ``grad_slots``: the FX pass that routes parameter gradients through writers;
- ``writer``: what a writer does on each call, and when it leaves a gradient alone;
- ``state``: the bucket slots learned from the comm hook;
- ``comm``: the comm hook (DDP's arithmetic, one in-place all-reduce per bucket);
- ``compat``: guards around the private torch APIs all of the above use.

See docs/ddp.md. ``DONATE_XLA_BUCKET_VIEW=0`` turns it off.
"""
from __future__ import annotations

from .integration import DDPGraphInfo, ModuleBinding, PreparedGraph, binding_of, capture, prepare

__all__ = ["capture", "prepare", "binding_of", "DDPGraphInfo", "ModuleBinding", "PreparedGraph"]
