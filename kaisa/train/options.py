"""Argument parser of ``kaisa-train``: every flag with its help text."""

from __future__ import annotations

import argparse
from typing import NoReturn

from kaisa.train.argtypes import finite, int_from, kl_clip
from kaisa.train.data import DATASETS
from kaisa.train.models import MODELS, TEXT_MODELS
from kaisa.train.optim import (
    DTYPES,
    MUON_CURVATURES,
    OPTIMIZERS,
    SCHEDULES,
    parse_worker_fraction,
)
from kaisa.train.preemption import add_arguments as add_preemption_arguments
from kaisa.train.text import add_arguments as add_lm_arguments

#: The main job's configurations (``--compare`` without a value): the first-order
#: baselines that set the target, then kaisa.KFAC and kaisa.EKFAC.
DEFAULT_COMPARE = "sgd,adamw,kfac,ekfac"

EPILOG = f"""\
examples:
  kaisa-train                                   # digits autoencoder, SGD
  kaisa-train --compare                         # the main job: {DEFAULT_COMPARE}
  kaisa-train --compare sgd,adamw,sgd+kfac      # side-by-side comparison + plot/table
  kaisa-train --task classify --model cnn --kfac --epochs 10
  kaisa-train --compare sgd@lr=0.1,sgd+kfac@lr=0.3@damping=0.01 --time-budget 10
  torchrun --standalone --nproc_per_node=2 -m kaisa.train --kfac
  torchrun --standalone --nproc_per_node=2 -m kaisa.train --task lm --fsdp --kfac
  torchrun --standalone --nproc_per_node=2 --max-restarts 3 -m kaisa.train --kfac \
      --checkpoint-every 30m --resume auto       # survives preemption and lost ranks
  kaisa-train --dataset cifar10 --data-dir ~/data --task classify --model resnet20 --kfac

Options shown as 'tuned' default to values tuned per task and optimiser on
digits (see docs/training.md); generic values are used for other datasets.
"""


def _add_kfac(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("K-FAC preconditioner (kaisa.KFACPreconditioner)")
    group.add_argument("--kfac", action="store_true", help="precondition gradients with K-FAC")
    add = group.add_argument
    add(
        "--kfac-factor-update-steps",
        type=int,
        default=None,
        metavar="N",
        help="update the Kronecker factors every N steps (default: tuned; 5 on digits, else 1)",
    )
    add(
        "--kfac-inv-update-steps",
        type=int,
        default=None,
        metavar="N",
        help="recompute eigendecompositions/inverses every N steps "
        "(default: tuned; 20 on digits, else 10)",
    )
    add(
        "--kfac-damping",
        type=float,
        default=None,
        metavar="X",
        help="Tikhonov damping added to the factors (default: tuned)",
    )
    add(
        "--kfac-factor-decay",
        type=float,
        default=None,
        metavar="X",
        help="running-average decay of the factors (default: tuned; 0.95 = kfac-pytorch's)",
    )
    add(
        "--kfac-kl-clip",
        type=kl_clip,
        default=None,
        metavar="X|none",
        help="KL-clip the preconditioned step; 'none' disables it (default: tuned, 0.001)",
    )
    add(
        "--kfac-compute-method",
        choices=("eigen", "inverse", "pi_inverse"),
        default=None,
        help="second-order method; pi_inverse: Cholesky inverses with pi-adjusted factored "
        "damping (default: pi_inverse for --optimizer kfac, else eigen)",
    )
    add(
        "--kfac-eigenvalue-outer-product",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="precompute the eigenvalue outer product (eigen method; default: on)",
    )
    add(
        "--kfac-grad-worker-fraction",
        type=parse_worker_fraction,
        default="comm_opt",
        metavar="comm_opt|mem_opt|hybrid_opt|auto|FLOAT",
        help="KAISA strategy, auto (fit --kfac-memory-budget-mb) or fraction of ranks that "
        "precondition each layer (default: %(default)s)",
    )
    add(
        "--kfac-assignment-strategy",
        choices=("compute", "memory"),
        default="compute",
        help="cost model for placing layers on ranks (default: %(default)s)",
    )
    add(
        "--kfac-colocate-factors",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compute both factors of a layer on the same rank (default: on)",
    )
    add(
        "--kfac-symmetry-aware",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="communicate only the upper triangle of symmetric factors (default: off)",
    )
    add(
        "--kfac-bucket-cap-mb",
        type=float,
        default=25.0,
        metavar="MB",
        help="allreduce bucket size in MB (default: %(default)s)",
    )
    add(
        "--kfac-memory-budget-mb",
        type=float,
        default=None,
        metavar="MB",
        help="per-rank memory budget; only with --kfac-grad-worker-fraction auto",
    )
    add(
        "--kfac-loglevel",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default="DEBUG",
        help="level of the preconditioner's log messages (default: %(default)s)",
    )
    add(
        "--kfac-factor-dtype",
        choices=tuple(DTYPES),
        default="none",
        help="dtype of the factors; none = parameter dtype (default: %(default)s)",
    )
    add(
        "--kfac-inv-dtype",
        choices=tuple(k for k in DTYPES if k != "none"),
        default="float32",
        help="dtype of the inverses/eigendecompositions (default: %(default)s)",
    )
    add(
        "--kfac-skip-layers",
        default="",
        metavar="REGEXES",
        help="comma-separated regular expressions; layers whose name or class name matches "
        "one are not preconditioned (e.g. 'fc,Conv2d')",
    )
    add(
        "--kfac-collective-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a K-FAC collective waits for its peers before failing (default: the "
        "process group's timeout)",
    )
    group.add_argument(
        "--kfac-curvature",
        choices=("mc", "type2", "empirical"),
        default="mc",
        help="optimizer kfac: G from sampled targets (mc), their expectation (type2: one "
        "backward pass per output column, at most 128) or the true loss (default: mc)",
    )
    group.add_argument(
        "--kfac-jvp", choices=("forward", "double_backward"), default=None,
        help="optimizer kfac: J v of the quadratic model by forward mode over a replayed "
        "forward (any attention kernel) or by double backward (default: double_backward "
        "for the digits autoencoder, else forward)",
    )
    group.add_argument(
        "--kfac-min-damping",
        type=float,
        default=1e-8,
        metavar="X",
        help="optimizer kfac: lower bound of the adaptive damping (default: %(default)s)",
    )
    group.add_argument(
        "--kfac-damping-interval",
        type=int,
        default=5,
        metavar="N",
        help="optimizer kfac: steps between Levenberg-Marquardt updates (default: %(default)s)",
    )
    group.add_argument(
        "--kfac-adaptive-damping",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="optimizer kfac: Levenberg-Marquardt damping (default: on)",
    )
    group.add_argument(
        "--kfac-basis-refresh", choices=("eigh", "qr", "auto"), default=None,
        help="eigenbases (ekfac, and the eigen method): a full eigh at every decomposition "
        "step, one warm-started QR step with eigh every --kfac-eigh-every-th, or auto: qr "
        "on a CUDA device, eigh elsewhere (default: eigh)",
    )
    group.add_argument(
        "--kfac-eigh-every", type=int, default=10, metavar="N",
        help="with --kfac-basis-refresh qr: every how many decomposition steps one is a "
        "full eigh (default: %(default)s)",
    )
    add(
        "--kfac-decomposition-spread", type=int, default=1, metavar="K",
        help="decompose the blocks in K parts of about equal cost, each on its own steps of "
        "the --kfac-inv-update-steps interval, so no step decomposes them all (not with "
        "--optimizer ekfac) (default: %(default)s)",
    )
    add(
        "--kfac-factor-storage", choices=("dense", "packed"), default="dense",
        help="running factors as matrices, or packed as their upper triangles: about half "
        "the factor memory, the same results (default: dense)",
    )
    add(
        "--kfac-approx", choices=("expand", "reduce"), default="expand",
        help="Linear layers on sequences: every position a row (expand) or one row per "
        "example (reduce: inputs averaged, output gradients summed) (default: expand)",
    )
    group.add_argument(
        "--kfac-layer-kinds", default=None, metavar="KINDS",
        help="block kinds to register: all, or a comma list of linear, conv2d, conv1d, "
        "embedding, scale_shift, attention (default: linear,conv2d for +kfac, "
        "linear,conv2d,conv1d,attention for --optimizer kfac)",
    )
    group.add_argument(
        "--kfac-cross-attention", default=None, metavar="REGEXES",
        help="comma-separated regular expressions naming the nn.MultiheadAttention modules with "
        "the cross-attention layout (default: every TransformerDecoderLayer.multihead_attn)",
    )
    group.add_argument(
        "--kfac-update-factors-in-hook",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="accumulate factors in the forward/backward hooks (default: on)",
    )


def _add_kfac_muon(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "K-FAC Muon (--optimizer kfac-muon: kaisa.KFACMuon)",
        "Muon (--lr, --weight-decay) on the weight matrices of the K-FAC blocks, AdamW on\n"
        "every other parameter (on --task lm also the tied embedding/head). Of the --kfac-*\n"
        "flags, --kfac-factor-update-steps, --kfac-factor-decay and --kfac-inv-update-steps\n"
        "(steps between refreshes of the input inverse or of the eigenbases) apply, and the\n"
        "placement, dtype, layer and logging ones; the damping, compute method, KL clip,\n"
        "eigenvalue outer product and factor updates in the hooks do not, and a\n"
        "decomposition spread, packed factor storage or memory budget is refused.",
    )
    group.add_argument(
        "--kfac-muon-curvature", choices=MUON_CURVATURES, default="eigen",
        help="what Muon orthogonalises: input: the gradient times the inverse of the "
        "layer's input second moment (Newton-Muon; no output-gradient hooks); eigen: "
        "EKFAC's Adam step in the Kronecker eigenbasis; identity: the gradient "
        "(torch.optim.Muon) (default: %(default)s)",
    )
    group.add_argument(
        "--kfac-muon-adamw-lr", type=finite(low=0.0), default=None, metavar="LR",
        help="AdamW's learning rate for the parameters Muon does not take, scheduled as "
        "--lr (default: tuned, the lr of --optimizer adamw)",
    )


class _Parser(argparse.ArgumentParser):
    """Errors are one line (no usage dump): ``kaisa-train: error: ... (see --help)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Create the ``kaisa-train`` argument parser."""
    parser = _Parser(
        prog="kaisa-train",
        description="Train small models with SGD/AdamW, optionally K-FAC preconditioned, "
        "and compare optimisers side by side.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--task",
        choices=("autoencode", "classify", "lm"),
        default="autoencode",
        help="autoencode: reconstruct inputs with MSE (classic K-FAC benchmark); "
        "classify: cross-entropy; lm: byte-level GPT on stdlib source (default: %(default)s)",
    )
    add(
        "--model",
        choices=(*MODELS, *TEXT_MODELS),
        default=None,
        help="model (default: autoencoder for autoencode, cnn for classify, gpt for lm)",
    )
    add("--dataset", choices=DATASETS, default=None,
        help="dataset (default: stdlib-text for lm, else digits)")
    add(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="CIFAR-10 directory with data_batch_1..5 and test_batch (or cifar-10-batches-py/)",
    )
    add(
        "--image-size",
        type=int_from(1),
        default=32,
        metavar="N",
        help="synthetic images are N x N (default: %(default)s)",
    )
    add(
        "--in-channels",
        type=int,
        default=3,
        metavar="C",
        help="channels of synthetic images (default: %(default)s)",
    )
    add(
        "--synthetic-size",
        type=int_from(1),
        default=1024,
        metavar="N",
        help="synthetic training examples (test: N/4; default: %(default)s)",
    )
    add(
        "--augment",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="random crop + flip (default: on for cifar10 only)",
    )
    add(
        "--eval-train",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="evaluate the full training set each epoch (default: on except cifar10)",
    )
    add(
        "--batch-size",
        type=int,
        default=None,
        metavar="N",
        help="examples (lm: windows) per micro-batch and process (default: 128; lm 32)",
    )
    add(
        "--epochs",
        type=int,
        default=None,
        metavar="N",
        help="epochs (default: 100 autoencode, 20 classify, 3 lm of --steps-per-epoch)",
    )
    add(
        "--time-budget",
        type=finite(positive=True),
        default=None,
        metavar="SECONDS",
        help="stop each configuration after this much training time",
    )
    add("--seed", type=int, default=0, help="seed for weights and data order (default: 0)")
    add(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="device (default: cuda when available)",
    )
    add(
        "--threads",
        type=int_from(0),
        default=None,
        metavar="N",
        help="torch CPU threads; 0 = torch's choice (default: 1 for digits, where tiny models "
        "run fastest single-threaded, else 0)",
    )
    group = parser.add_argument_group("optimisation")
    add = group.add_argument
    add(
        "--optimizer",
        choices=OPTIMIZERS,
        default="sgd",
        help="optimiser; kfac is kaisa.KFAC: K-FAC with adaptive lr, momentum and damping; "
        "ekfac is kaisa.EKFAC: Adam in the K-FAC eigenbasis; kfac-muon is kaisa.KFACMuon: "
        "Muon on the weight matrices after K-FAC's curvature, AdamW on the rest "
        "(default: %(default)s)",
    )
    add("--lr", type=finite(low=0.0), default=None,
        help="base learning rate; kfac-muon: Muon's (default: tuned; kfac-muon 0.05 on "
        "--task lm, else 0.02)")
    add("--momentum", type=float, default=0.9, help="SGD momentum (default: %(default)s)")
    add(
        "--nesterov",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Nesterov momentum for SGD (default: off)",
    )
    add(
        "--weight-decay",
        type=finite(low=0.0),
        default=0.0,
        help="weight decay (kfac-muon: Muon's and AdamW's) (default: %(default)s)",
    )
    add(
        "--schedule",
        choices=SCHEDULES,
        default="constant",
        help="learning-rate schedule over --epochs (default: %(default)s)",
    )
    add(
        "--warmup-epochs",
        type=finite(low=0.0),
        default=0.0,
        metavar="E",
        help="linear warmup length in epochs (default: %(default)s)",
    )
    add(
        "--accumulation-steps",
        "--kfac-accumulation-steps",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per optimiser step, for every configuration and K-FAC "
        "(default: %(default)s)",
    )
    _add_kfac(parser)
    _add_kfac_muon(parser)
    add_lm_arguments(parser, int_from(1))
    group = parser.add_argument_group("comparison and output")
    add = group.add_argument
    add(
        "--compare",
        nargs="?",
        const=DEFAULT_COMPARE,
        default=None,
        metavar="CONFIGS",
        help="comma-separated configurations OPTIMIZER[+kfac][@key=value...], e.g. "
        "sgd,adamw,sgd+kfac@lr=0.3; each runs with the same seed, weights, data order, "
        f"budget (--compare alone: {DEFAULT_COMPARE})",
    )
    add(
        "--target",
        type=finite(),
        default=None,
        help="override the target of the validation metric (test MSE for autoencode, test "
        "accuracy for classify, validation loss for lm); default: the best final value "
        "of the first-order configurations (sgd, adamw), as in AlgoPerf",
    )
    add("--name", default=None, help="run name (default: DATASET-MODEL-TASK)")
    add("--run-dir", default="runs", help="parent directory of runs (default: %(default)s)")
    add(
        "--overwrite",
        action="store_true",
        help="replace an existing run of the same name (without it, reusing a name is refused)",
    )
    add(
        "--fsdp",
        action="store_true",
        help="--task lm under torchrun: shard the GPT with FSDP2 (fully_shard per transformer "
        "block and the root) instead of DDP; checkpoints become DCP directories that resume "
        "at any world size (not with --optimizer kfac); not for --optimizer kfac-muon",
    )
    add(
        "--replicate",
        type=int_from(1),
        default=1,
        metavar="R",
        help="with --fsdp: HSDP, R replicas of the model each sharded over world/R processes "
        "(default: %(default)s, shard over all)",
    )
    add(
        "--pg-timeout",
        type=finite(positive=True),
        default=None,
        metavar="SECONDS",
        help="torch.distributed process-group timeout under torchrun (default: torch's, "
        "30 min on gloo)",
    )
    add(
        "--plot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write runs/NAME/comparison.png (default: on)",
    )
    add(
        "--log-every",
        type=int_from(1),
        default=1,
        metavar="N",
        help="print a summary line every N epochs (default: %(default)s)",
    )
    add("--quiet", action="store_true", help="no progress bar and no per-epoch lines")
    add_preemption_arguments(parser)
    return parser
