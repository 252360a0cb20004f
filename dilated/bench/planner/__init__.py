"""Planning context parallelism beyond the GPUs at hand: a model of each strategy's schedule on
calibrated kernel and link times (``dilated-bench calibrate``), its predictions for a cluster
(``dilated-bench plan``) and their check against measured runs (``plan --validate``)."""
from .calibration import Calibration, Curve, KernelPoint
from .kernel_model import KernelModel
from .network import InterNode, Network
from .schedules import Model, Prediction, Problem

__all__ = ["Calibration", "Curve", "KernelPoint", "KernelModel", "InterNode", "Network", "Model", "Prediction",
           "Problem"]
