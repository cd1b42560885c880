"""Real Hugging Face architectures, built from tiny configs (nothing is downloaded).

GPT-2 (``Conv1D`` projections), Llama (RMS norms, grouped-query attention), Qwen3 (also
``q_norm``/``k_norm`` over the head dim), BERT (masked LM, head tied to the embedding) and
T5 (encoder-decoder, ``T5LayerNorm``), each of width 64 with 2 layers and a vocabulary of
96. The file checks that:

* every product (``EKFAC``, ``KFACPreconditioner`` + SGD, ``KFACMuon``, ``KFAC``) takes 3
  finite steps on every model;
* the share of elements preconditioned (``coverage()``) is what was measured, and the
  first-order parameters are exactly the ones expected;
* the factors under activation checkpointing equal those without, bit for bit (float64);
* EKFAC steps finitely under bf16 autocast;
* HF ``Trainer`` with ``kaisa.EKFAC`` equals the plain loop bit for bit;
* timm's ViT, ConvNeXt and BEiT step with EKFAC (skipped where timm is not installed).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kaisa

transformers = pytest.importorskip("transformers")

VOCAB, WIDTH, SEQ, BATCH = 96, 64, 12, 2
MODELS = ("gpt2", "llama", "qwen3", "bert", "t5")
PRODUCTS = ("EKFAC", "KFACPreconditioner", "KFACMuon", "KFAC")
#: The special tokens inside the vocabulary (HF warns about ids outside it).
_SPECIAL = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)


def _gpt2(**config: Any) -> nn.Module:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=32,
        bos_token_id=0, eos_token_id=0, **config))
    model.loss_type = "ForCausalLM"  # its class name maps to no loss: HF would warn
    return model


def _llama(**config: Any) -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        **_SPECIAL, **config))


def _qwen3(**config: Any) -> nn.Module:
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=WIDTH // 2,
        max_position_embeddings=32, **_SPECIAL, **config))


def _bert(**config: Any) -> nn.Module:
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=32, pad_token_id=0, **config))


def _t5(**config: Any) -> nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // 2, d_ff=2 * WIDTH, num_layers=2,
        num_heads=2, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **config))


_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "gpt2": _gpt2, "llama": _llama, "qwen3": _qwen3, "bert": _bert, "t5": _t5,
}


def _model(name: str, **config: Any) -> nn.Module:
    """The tiny model ``name`` from seed 0 (``config``: overrides of its config)."""
    torch.manual_seed(0)
    return _BUILDERS[name](**config)


def _tokens(step: int, batch: int = BATCH) -> torch.Tensor:
    """A batch of token ids (no special token), fixed by ``step``."""
    return torch.randint(1, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(step))


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """HF's own loss with ``labels=ids`` (causal LM, masked LM on every token, seq2seq)."""
    return model(input_ids=ids, labels=ids).loss


def _product(product: str, model: nn.Module) -> Any:
    if product == "EKFAC":
        return kaisa.EKFAC(model, lr=1e-3)
    if product == "KFACPreconditioner":
        return kaisa.KFACPreconditioner(model, layer_kinds="all")
    if product == "KFACMuon":
        return kaisa.KFACMuon(model, lr=0.02)
    # empirical curvature with fixed lr/momentum: steps after loss.backward(), no closure
    return kaisa.KFAC(model, loss="cross_entropy", curvature="empirical", lr=0.01, momentum=0.0)


def _finite(tensors: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _share(model: nn.Module, coverage: dict[str, str]) -> float:
    """The share of the parameters' elements preconditioned by a block."""
    sizes = dict(model.named_parameters())
    done = sum(sizes[name].numel() for name, kind in coverage.items() if kind != "first-order")
    return done / sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("product", PRODUCTS)
@pytest.mark.parametrize("name", MODELS)
def test_each_product_takes_finite_steps_on_each_model(name: str, product: str) -> None:
    model = _model(name)
    before = [p.detach().clone() for p in model.parameters()]
    opt = _product(product, model)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01) if product == "KFACPreconditioner" else None
    for step in range(3):
        model.zero_grad()
        loss = _loss(model, _tokens(step))
        loss.backward()
        opt.step()
        if sgd is not None:  # the preconditioner only rewrites the gradients
            sgd.step()
        assert bool(torch.isfinite(loss)), (step, loss)
        assert _finite(p.grad for p in model.parameters() if p.grad is not None), step
    assert _finite(model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


#: Measured with these configs, floored to 3 decimals: (EKFAC, whose default kinds leave
#: the norms first-order; KFACPreconditioner(layer_kinds="all")). Exact values: GPT-2
#: 0.994090 / 1.0, Llama 0.996294 / 1.0, Qwen3 0.994819 / 1.0, BERT 0.989170 / 0.998797,
#: T5 0.995506 / 1.0 (the norms are a larger share at a smaller width: GPT-2 of width 32
#: is 0.989 under EKFAC).
_SHARES = {
    "gpt2": (0.994, 1.0),
    "llama": (0.996, 1.0),
    "qwen3": (0.994, 1.0),
    # BERT: 96 of its 79,776 elements stay first-order with every kind, the head's bias
    # cls.predictions.bias (HF ties cls.predictions.decoder.bias to it, named_parameters()
    # names it once). The decoder's weight is tied to the word embedding: kaisa makes the
    # two one TiedEmbeddingBlock (kind "embedding", in the embedding's orientation) that
    # holds the tied weight only, and the head's bias, which the embedding lacks, stays
    # first-order (kaisa/blocks/tied.py).
    "bert": (0.989, 0.998),
    "t5": (0.995, 1.0),
}


@pytest.mark.parametrize("name", MODELS)
def test_coverage_is_the_measured_share(name: str) -> None:
    """The first-order parameters: the norms' (LayerNorm, ``LlamaRMSNorm``, ``Qwen3RMSNorm``
    with q_norm/k_norm, ``T5LayerNorm``) under EKFAC's kinds, none under ``"all"`` (the
    norms are ``scale_shift`` blocks, GPT-2's ``Conv1D`` linear ones), BERT's head bias in
    both."""
    model = _model(name)
    norms = {f"{module_name}.{param_name}" for module_name, module in model.named_modules()
             if type(module).__name__.endswith(("LayerNorm", "RMSNorm"))
             for param_name, _ in module.named_parameters(recurse=False)}
    assert norms
    head_bias = {"cls.predictions.bias"} if name == "bert" else set()
    ekfac_share, all_share = _SHARES[name]
    makers: list[tuple[Callable[[nn.Module], Any], float, set[str]]] = [
        (lambda m: kaisa.EKFAC(m, lr=1e-3), ekfac_share, norms | head_bias),
        (lambda m: kaisa.KFACPreconditioner(m, layer_kinds="all"), all_share, head_bias),
    ]
    for make, share, first_order in makers:
        net = _model(name)
        opt = make(net)
        _loss(net, _tokens(0)).backward()
        opt.step()  # a layer whose hooks never fired would be first-order from here
        coverage = opt.coverage()
        assert set(coverage) == {n for n, _ in net.named_parameters()}
        assert {n for n, kind in coverage.items() if kind == "first-order"} == first_order
        assert _share(net, coverage) >= share, (_share(net, coverage), coverage)
        if not first_order - head_bias:
            assert all(coverage[n] == "scale_shift" for n in norms), coverage
        if name == "gpt2":
            assert all(coverage[f"{n}.{p}"] == "linear" for n, m in net.named_modules()
                       if type(m).__name__ == "Conv1D" for p in ("weight", "bias")), coverage


def _probe(model: Any, name: str) -> nn.Module:
    """A projection inside the first checkpointed decoder layer."""
    if name == "gpt2":
        return model.transformer.h[0].mlp.c_fc
    return model.model.layers[0].mlp.up_proj


def _checkpoint_activations(model: Any, reentrant: bool) -> None:
    """HF's activation checkpointing (``gradient_checkpointing_enable`` before 5.x's rename)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_factors_under_activation_checkpointing_equal_the_plain_ones(
    name: str, reentrant: bool
) -> None:
    """float64, GPT-2 with its dropout (checkpointing replays the RNG state): every factor
    and every preconditioned gradient bit for bit."""
    ids = _tokens(0)
    runs = []
    for checkpointed in (False, True):
        model = _model(name).double().train()
        if checkpointed:
            _checkpoint_activations(model, reentrant)
        calls: list[int] = []
        handle = _probe(model, name).register_forward_hook(
            lambda *_, calls=calls: calls.append(1))
        pre = kaisa.KFACPreconditioner(model, layer_kinds="all", factor_update_steps=1,
                                       inv_update_steps=1)
        torch.manual_seed(1)  # the same dropout masks in both runs
        _loss(model, ids).backward()
        pre.step()
        handle.remove()
        assert len(calls) == (2 if checkpointed else 1)  # the layer was recomputed
        runs.append((model, pre))
    (plain, ours), (checkpointed_model, theirs) = runs
    assert list(ours.layers) == list(theirs.layers)
    for block in ours.layers:
        mine, other = ours.layers[block], theirs.layers[block]
        assert mine.a is not None or mine.g is not None, block
        for side in ("a", "g"):
            x, y = getattr(mine, side), getattr(other, side)
            assert (x is None) == (y is None), (block, side)
            if x is not None:
                assert torch.equal(x, y), (block, side, (x - y).abs().max())
    for (param, x), y in zip(plain.named_parameters(), checkpointed_model.parameters(),
                             strict=True):
        assert x.grad is not None and y.grad is not None and torch.equal(x.grad, y.grad), param


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_ekfac_under_bf16_autocast_is_finite(name: str) -> None:
    model = _model(name)
    opt = kaisa.EKFAC(model, lr=1e-3)
    for step in range(3):
        opt.zero_grad()
        ids = _tokens(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        assert out.logits.dtype == torch.bfloat16  # the forward ran in bf16
        out.loss.backward()
        opt.step()
        assert bool(torch.isfinite(out.loss)), (step, out.loss)
    assert _finite(model.parameters())
    factors = [f for b in opt.curvature.layers.values() for f in (b.a, b.g) if f is not None]
    assert factors and _finite(factors)


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Rows of token ids, each its own labels."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_hf_trainer_with_ekfac_equals_the_plain_loop(tmp_path: Any) -> None:
    """GPT-2 without dropout; the Trainer reads the dataset in order (its sampler
    overridden), does not clip, keeps the lr constant: parameters bit for bit."""
    pytest.importorskip("accelerate")

    class InOrder(transformers.Trainer):  # the dataset in order
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler[int]:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model, reference = _model("gpt2", **no_dropout), _model("gpt2", **no_dropout)
    ids, batch = _tokens(7, batch=12), 4
    seen: list[dict[str, Any]] = []

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert not args
        seen.append({k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                     for k, v in kwargs.items() if v is not None})

    model.register_forward_pre_hook(record, with_kwargs=True)
    opt = kaisa.EKFAC(model, lr=1e-3)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=batch, max_steps=3,
        report_to=[], logging_strategy="no", save_strategy="no", use_cpu=True, seed=0,
        dataloader_drop_last=True, max_grad_norm=0.0, lr_scheduler_type="constant",
        warmup_steps=0, disable_tqdm=True,
    )
    trainer = InOrder(model=model, args=args, train_dataset=_Tokens(ids), optimizers=(opt, None))
    trainer.train()
    assert opt.steps == 3 and len(seen) == 3
    assert opt.param_groups[0]["lr"] == 1e-3

    ref_opt = kaisa.EKFAC(reference, lr=1e-3)
    for step, kwargs in enumerate(seen):
        rows = ids[step * batch:(step + 1) * batch]
        assert torch.equal(kwargs.pop("input_ids"), rows)
        assert torch.equal(kwargs.pop("labels"), rows)
        # what else the Trainer passed: the loss's normaliser num_items_in_batch (the
        # count of predicted tokens; the mean's, bit for bit, with transformers 5.25)
        ref_opt.zero_grad()
        reference(input_ids=rows, labels=rows, **kwargs).loss.backward()
        ref_opt.step()
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b), (name, (a - b).abs().max())


def test_hf_convnext_channels_first_norm_has_the_explicit_fisher() -> None:
    """float64: ``ConvNextLayerNorm(data_format="channels_first")``'s scale statistic is
    ``mean_r (xhat_r d_r)^2`` over the rows of channels (as it is with "channels_last"):
    the norm permutes NCHW inside its forward, and the block takes its rows so."""
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm

    channels, eps = 8, 1e-6
    torch.manual_seed(0)
    norm = ConvNextLayerNorm(channels, eps=eps, data_format="channels_first").double()
    pre = kaisa.KFACPreconditioner(norm, factor_decay=1e-300, kl_clip=None, layer_kinds="all")
    assert pre.coverage() == {"weight": "scale_shift", "bias": "scale_shift"}
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, channels, 5, 5, dtype=torch.float64, generator=g)
    out = norm(x)
    r = torch.randn(out.shape, dtype=torch.float64, generator=g)
    (out * r).sum().backward()  # the output gradient is exactly r
    pre.step()
    rows = x.permute(0, 2, 3, 1).reshape(-1, channels)
    d = r.permute(0, 2, 3, 1).reshape(-1, channels)
    mean, var = rows.mean(-1, keepdim=True), rows.var(-1, unbiased=False, keepdim=True)
    xhat = (rows - mean) / torch.sqrt(var + eps)
    block = pre.layers[""]
    assert block.g is not None
    torch.testing.assert_close(block.g[0, 0], ((xhat * d) ** 2).mean(0), rtol=1e-12, atol=1e-14)


#: timm models (``pretrained=False``: built, not downloaded), tiny: 32x32 images.
_TIMM: dict[str, tuple[str, dict[str, Any]]] = {
    "vit": ("vit_tiny_patch16_224",
            dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)),
    "convnext": ("convnext_atto", dict(depths=(1, 1, 1, 1), dims=(16, 32, 48, 64))),
    "beit": ("beit_base_patch16_224",
             dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)),
}


@pytest.mark.parametrize("name", list(_TIMM))
def test_timm_models_take_finite_steps_with_ekfac(name: str) -> None:
    """BEiT calls ``F.linear(x, self.qkv.weight, cat(q_bias, k_bias, v_bias))``: the hooks of
    its ``qkv`` never fire, and kaisa reports it first-order after the first step (and
    warns), unless a later kaisa sees the functional call: then the block has factors."""
    # 0.9: the model functions take dict(model_args, **kwargs) (overrides, not duplicates)
    timm = pytest.importorskip(  # timm needs torchvision, which has no build for torch 2.13
        "timm", minversion="0.9", reason="timm (and the torchvision it needs) is not installed")
    arch, kwargs = _TIMM[name]
    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, num_classes=10, **kwargs)
    opt = kaisa.EKFAC(model, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            opt.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            opt.step()
            assert bool(torch.isfinite(loss)), (step, loss)
    assert _finite(model.parameters())
    coverage = opt.coverage()
    assert any(kind != "first-order" for kind in coverage.values()), coverage
    if name == "beit":
        kind = coverage["blocks.0.attn.qkv.weight"]
        if kind == "first-order":
            assert any("blocks.0.attn.qkv" in str(w.message) for w in caught), caught
        else:
            block = opt.curvature.layers["blocks.0.attn.qkv"]
            assert block.a is not None and block.g is not None, kind
