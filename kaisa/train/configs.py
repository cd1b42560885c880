"""Training configurations: ``--compare`` specs and tuned per-task defaults.

A configuration is ``OPTIMIZER[+kfac][@key=value...]``, e.g. ``sgd``,
``adamw+kfac`` or ``sgd+kfac@lr=0.3@damping=0.01``. Overrides accept the
destination of any optimisation or ``--kfac-*`` flag (``lr``, ``momentum``,
``weight-decay``, ``damping``, ``kl-clip``, ``inv-update-steps`` ...).
"""

from __future__ import annotations

import argparse
import copy
import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any

from kaisa.train.optim import OPTIMIZERS, OWN_CURVATURE

#: Option destinations a ``@key=value`` override may change. Everything else
#: (model, data, batch size, budget, seed) is shared so comparisons are fair.
OVERRIDABLE: frozenset[str] = frozenset(
    {"lr", "momentum", "nesterov", "weight_decay", "schedule", "warmup_epochs"}
)

#: SGD + KFACPreconditioner's tuned schedule on the digits tasks.
_SGD_KFAC_STEPS = {"kfac_factor_update_steps": 5, "kfac_inv_update_steps": 20}

#: Defaults used when a flag is not given, by (task, optimizer, kfac). Tuned on
#: digits with ``bench/convergence/convergence.py`` (see docs/training.md); other datasets
#: fall back to the ``None`` task entries.
TUNED: dict[tuple[str | None, str, bool], dict[str, Any]] = {
    ("autoencode", "sgd", False): {"lr": 2.0},
    ("autoencode", "adamw", False): {"lr": 3e-3},
    ("autoencode", "sgd", True): {"lr": 0.3, "kfac_damping": 0.03, **_SGD_KFAC_STEPS},
    ("autoencode", "adamw", True): {"lr": 1e-3, "kfac_damping": 0.03},  # not tuned
    ("classify", "sgd", False): {"lr": 0.1},
    ("classify", "adamw", False): {"lr": 1e-2},
    ("classify", "sgd", True): {"lr": 0.3, "kfac_damping": 0.1, **_SGD_KFAC_STEPS},
    ("classify", "adamw", True): {"lr": 1e-3, "kfac_damping": 0.1},  # not tuned
    # kaisa.KFAC: lr and momentum are adaptive; these are its curvature settings.
    ("autoencode", "kfac", False): {  # 3 seeds, 60 epochs (docs/training.md)
        "kfac_damping": 1e-4,
        "kfac_factor_update_steps": 1,
        "kfac_inv_update_steps": 1,
        "kfac_factor_decay": 0.8,
        "kfac_compute_method": "pi_inverse",
        "kfac_jvp": "double_backward",  # 8% cheaper per step than forward mode here
    },
    ("classify", "kfac", False): {  # 3 seeds: 97% at epochs 8/10/6
        # (bench/convergence/convergence.py); damping 0.01 and 1e-3 diverged in the first epoch
        "kfac_damping": 0.1,
        "kfac_factor_update_steps": 1,
        "kfac_inv_update_steps": 3,
        "kfac_factor_decay": 0.8,
        "kfac_compute_method": "pi_inverse",
    },
    # --task lm (byte GPT on stdlib text). AdamW 3e-3: best of 1e-3/3e-3/1e-2 in the anchors
    # (300 steps, context 64, batch 32); the rest: bench/convergence/gpt.py (docs/training.md).
    ("lm", "sgd", False): {"lr": 0.3},  # not tuned
    ("lm", "adamw", False): {"lr": 3e-3},
    ("lm", "sgd", True): {"lr": 0.1, "kfac_damping": 0.03},  # not tuned
    ("lm", "adamw", True): {  # the anchors' KFACPreconditioner + AdamW
        "lr": 3e-3,
        "kfac_damping": 0.03,
        "kfac_factor_update_steps": 1,
        "kfac_inv_update_steps": 10,
    },
    ("lm", "kfac", False): {  # a quick check only, not tuned
        "kfac_damping": 0.1,
        "kfac_factor_update_steps": 1,
        "kfac_inv_update_steps": 5,
        "kfac_compute_method": "pi_inverse",
    },
    (None, "kfac", False): {
        "kfac_damping": 1e-3,
        "kfac_inv_update_steps": 5,
        "kfac_compute_method": "pi_inverse",
    },
    # kaisa.EKFAC: factors every step, bases every 10 steps. Autoencoder: 1e-2 of
    # 1e-3/3e-3/1e-2 (seed 0, 100 epochs): first to AdamW's final test MSE (epoch 30;
    # 37, 65), final 0.0064 (0.0058, 0.0072; docs/training.md, "Example: the main job")
    ("autoencode", "ekfac", False): {"lr": 1e-2},
    ("classify", "ekfac", False): {"lr": 1e-2},
    ("lm", "ekfac", False): {"lr": 1e-2, "kfac_factor_update_steps": 1,
                             "kfac_inv_update_steps": 10},
    (None, "ekfac", False): {"lr": 1e-3},
    (None, "sgd", False): {"lr": 0.1},
    (None, "adamw", False): {"lr": 1e-3},
    (None, "sgd", True): {"lr": 0.1},
    (None, "adamw", True): {"lr": 1e-3},
}

# kaisa.KFACMuon, not tuned here: Muon's lr 0.05 on the LM task (torch.optim.Muon's lr on the
# byte GPT in bench/convergence/gpt.py, docs/training.md), a generic 0.02 elsewhere; the
# parameters Muon does not take get the AdamW lr of the same task.
TUNED |= {
    (task, "kfac-muon", False): {
        "lr": 0.05 if task == "lm" else 0.02,
        "kfac_muon_adamw_lr": TUNED[(task, "adamw", False)]["lr"],
    }
    for task in ("autoencode", "classify", "lm", None)
}

#: Fallbacks for options whose CLI default is ``None`` ("tuned").
FALLBACK: dict[str, Any] = {
    "kfac_damping": 0.001,
    "kfac_factor_decay": 0.95,
    "kfac_kl_clip": "0.001",
    "kfac_factor_update_steps": 1,
    "kfac_inv_update_steps": 10,
    "kfac_compute_method": "eigen",
    "kfac_jvp": "forward",
}


@dataclass(frozen=True)
class RunSpec:
    """One configuration of a (possibly single-entry) comparison."""

    optimizer: str
    kfac: bool
    overrides: dict[str, str] = field(default_factory=dict)
    text: str = ""

    @property
    def label(self) -> str:
        """Display name, e.g. ``sgd+kfac@lr=0.3``."""
        return self.text or self.optimizer + ("+kfac" if self.kfac else "")

    @property
    def slug(self) -> str:
        """File-system-safe form of :attr:`label`."""
        return re.sub(r"[^A-Za-z0-9.+=-]+", "_", self.label)


def _override_dest(key: str, parser: argparse.ArgumentParser) -> argparse.Action:
    name = key.strip().lower().replace("-", "_")
    actions = {action.dest: action for action in parser._actions}
    for dest in (name, f"kfac_{name}"):
        if dest in actions and (dest in OVERRIDABLE or dest.startswith("kfac_")):
            return actions[dest]
    raise ValueError(
        f"cannot override {key!r} per configuration; overridable: "
        f"{', '.join(sorted(o.replace('_', '-') for o in OVERRIDABLE))} and any kfac-* option"
    )


def parse_spec(text: str, parser: argparse.ArgumentParser) -> RunSpec:
    """Parse one ``OPTIMIZER[+kfac][@key=value...]`` item.

    Raises:
        ValueError: For an unknown optimiser, suffix or override key.
    """
    base, *items = text.strip().split("@")
    optimizer, plus, suffix = base.partition("+")
    if optimizer not in OPTIMIZERS or (plus and (suffix != "kfac" or optimizer in OWN_CURVATURE)):
        raise ValueError(
            f"invalid configuration {text!r}: expected OPTIMIZER[+kfac][@key=value...] "
            f"with OPTIMIZER one of {', '.join(OPTIMIZERS)}"
        )
    overrides: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise ValueError(f"invalid override {item!r} in {text!r}: expected key=value")
        overrides[_override_dest(key, parser).dest] = value
    return RunSpec(optimizer=optimizer, kfac=bool(plus), overrides=overrides, text=text.strip())


def _convert(action: argparse.Action, value: str) -> Any:
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false for {action.dest}, got {value!r}")
    converted = action.type(value) if callable(action.type) else value
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"invalid {action.dest} {value!r}; choose from {choices}")
    return converted


def resolve(
    spec: RunSpec, options: argparse.Namespace, parser: argparse.ArgumentParser
) -> argparse.Namespace:
    """Options for ``spec``: shared flags, then its overrides, then tuned defaults."""
    resolved = copy.copy(options)
    resolved.optimizer, resolved.kfac, resolved.label = spec.optimizer, spec.kfac, spec.label
    actions = {action.dest: action for action in parser._actions}
    for dest, value in spec.overrides.items():
        try:
            setattr(resolved, dest, _convert(actions[dest], value))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as error:
            raise ValueError(
                f"invalid value {value!r} for {dest} in {spec.label!r}: {error}"
            ) from error
    task = options.task if options.dataset in ("digits", "stdlib-text") else None
    tuned = TUNED[(task, spec.optimizer, spec.kfac)] | {
        k: v for k, v in FALLBACK.items() if k not in TUNED[(task, spec.optimizer, spec.kfac)]
    }
    for dest, value in tuned.items():
        if getattr(resolved, dest, None) is None:
            setattr(resolved, dest, value)
    return resolved


def settings(options: argparse.Namespace) -> dict[str, Any]:
    """Every resolved option of one configuration as JSON-safe values.

    Recorded in ``summary.json``, at the head of ``metrics.jsonl`` and in checkpoints
    (where ``--resume`` compares it).
    """
    out: dict[str, Any] = {}
    for key, value in sorted(vars(options).items()):
        if isinstance(value, enum.Enum):
            value = value.value
        plain = isinstance(value, (str, int, bool, type(None))) or (
            isinstance(value, float) and math.isfinite(value)
        )
        if not plain:
            value = str(value)
        out[key] = value
    return out
