"""Planning at scale: memory, communication and step time of a layout on many GPUs.

``estimate(model, layout, hardware)`` predicts one layout; ``search(model, gpus=...,
hardware=...)`` ranks the layouts that fit. Models are ``ModelShape`` (presets in
``MODELS``), hardware ``Hardware`` (presets in ``HARDWARE``, or a TOML file that
``%mesh calibrate`` writes). Plain Python: no torch, so it runs anywhere, fast.
"""

from meshlab.plan.estimate import Collective, Estimate, estimate
from meshlab.plan.hardware import HARDWARE, Hardware, Link, hardware, load, save
from meshlab.plan.layout import IMPLEMENTATIONS, Layout
from meshlab.plan.layout_check import check
from meshlab.plan.precision import PRECISIONS, Precision
from meshlab.plan.search import search
from meshlab.plan.shapes import MODELS, ModelShape, model_shape

__all__ = ["HARDWARE", "IMPLEMENTATIONS", "MODELS", "PRECISIONS", "Collective", "Estimate",
           "Hardware", "Layout", "Link", "ModelShape", "Precision", "check", "estimate",
           "hardware", "load", "model_shape", "save", "search"]
