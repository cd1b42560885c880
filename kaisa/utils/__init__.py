"""Small helpers every other package may use, and which use nothing of kaisa's.

The enumerations the constructors accept (:mod:`kaisa.utils.enums`), hyperparameters that
may be numbers or callables of the step (:mod:`kaisa.utils.hyperparams`), the one dtype
rule (:mod:`kaisa.utils.dtypes`), finiteness without a host synchronisation per tensor
(:mod:`kaisa.utils.finite`), timed regions and the phase profile
(:mod:`kaisa.utils.profiling`), the first-order update rules written once
(:mod:`kaisa.utils.first_order`) and the rows of FSDP2-sharded parameters
(:mod:`kaisa.utils.shards`).
"""
