"""``kaisa.plan``: what an iteration will cost, by phase, at any world size and fraction.

A cost model over the engine's own placement (:mod:`kaisa.distributed`): compute from a
profile or a microbenchmark (:mod:`~kaisa.plan.compute`), alpha-beta collectives on a network
spec (:mod:`~kaisa.plan.collectives`, :mod:`~kaisa.plan.network`), the overlap of factor
buckets with the backward pass and the memory model (:mod:`~kaisa.plan.iteration`), and
the recommendation of a fraction and intervals (:mod:`~kaisa.plan.search`). Models are
read on the meta device (:mod:`~kaisa.plan.workload`). ``python -m kaisa.plan`` prints
the tables; :class:`FractionObjective` is what ``grad_worker_fraction='auto'`` minimises
when given as :attr:`kaisa.distributed.DistributedConfig.cost_model`.
"""

from kaisa.plan.collectives import Algorithm, Collective, bucketed_time, collective_time, link_time
from kaisa.plan.compute import ComputeProfile, KernelFit, fit_kernel, load_profile, microbenchmark
from kaisa.plan.iteration import PHASES, FractionObjective, IterationModel, PlanConfig, StepCost
from kaisa.plan.measure import fit_link, measure_link, measured_network
from kaisa.plan.network import PRESETS, Link, NetworkSpec, parse_network
from kaisa.plan.search import Recommendation, recommend
from kaisa.plan.workload import BlockShape, Workload, load_workload, workload_from_module

__all__ = [
    "PHASES",
    "PRESETS",
    "Algorithm",
    "BlockShape",
    "Collective",
    "ComputeProfile",
    "FractionObjective",
    "IterationModel",
    "KernelFit",
    "Link",
    "NetworkSpec",
    "PlanConfig",
    "Recommendation",
    "StepCost",
    "Workload",
    "bucketed_time",
    "collective_time",
    "fit_kernel",
    "fit_link",
    "link_time",
    "load_profile",
    "load_workload",
    "measure_link",
    "measured_network",
    "microbenchmark",
    "parse_network",
    "recommend",
    "workload_from_module",
]
