"""The unit protocol (docs/design.md §1): what zerojax's schedules need of a model, and nothing more.

A model is a Flax NNX module with

    STACKED = ("layers",)            # attributes holding stacks of identical blocks, run in order;
                                     # each made under nnx.vmap (a leading layer axis on every leaf)
    def enter(self, batch) -> x      # everything before the first stack
    def between(self, name, x, batch) -> x   # glue before stack `name` (every stack but the first)
    def exit(self, x, batch) -> loss # everything after the last stack: the mean loss over its rows,
                                     # or (mean loss, weight) for a loss whose rows weigh differently

and each block is called `block(x) -> x`, x a pytree of arrays (each with the batch as its leading
dim) that keeps its shapes and dtypes (integer leaves, such as positions, pass through as they
are). `batch` is a pytree of arrays too, the batch axis first on every leaf: every leaf is
sharded over (replica, data) and split into microbatches the same way. A language model's
batch contract (a bare token array, or `tokens` with a loss mask, packing and prefix fields) is
at the end of this module. `enter`, `between` and `exit` may read any parameter that
is not in a stack; none of them may read a stack. Every parameter is an `nnx.Param`.

Losses and weights. Every call of `exit` (one per device and microbatch under the explicit
schedule, one per microbatch under gspmd) returns a mean `l` over the rows it was given and a
weight `w` (1 when it returns a bare loss). The step's loss is Σ w·l / Σ w over the calls, and
its gradient is that loss's gradient: a masked loss that returns (masked mean, number of
unmasked targets) is the mean over every unmasked target of the global batch, whatever the mesh
or `train.grad_accum`; a bare loss is the mean of equal-sized slices, i.e. over every row.

`Units` splits a model into what the schedules apply: the outer unit (every parameter outside
the stacks, as FSDP's root unit) and one unit per layer of each stack. Nothing here knows a
mesh; nothing in the schedules knows a model's attributes.
"""

from __future__ import annotations

import inspect
from functools import partial
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from zerojax.models import attention

REMAT_POLICIES = {  # model.remat: what a block's backward may reuse from its forward
    "none": jax.checkpoint_policies.everything_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class ProtocolError(TypeError):
    """A model that does not follow the unit protocol (bad input, not a bug in the model)."""


def _identity(x):
    return x


def check(model) -> tuple[str, ...]:
    """The model's stack names, after checking it follows the protocol (ProtocolError if not)."""
    if not isinstance(model, nnx.Module):
        raise ProtocolError(f"the factory returned a {type(model).__name__}, not a flax.nnx.Module")
    stacked = getattr(type(model), "STACKED", None)
    if not isinstance(stacked, tuple) or not stacked or not all(isinstance(s, str) for s in stacked):
        raise ProtocolError("the model has no STACKED class attribute (a non-empty tuple of attribute names, "
                            "e.g. STACKED = ('layers',))")
    for method in ("enter", "exit") + (("between",) if len(stacked) > 1 else ()):
        if not callable(getattr(model, method, None)):
            raise ProtocolError(f"the model has no `{method}` method")
    others = [type(v).__name__ for _, v in nnx.iter_graph(model)
              if isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param)]
    if others:
        raise ProtocolError(f"the model holds {sorted(set(others))} variables; only nnx.Param is supported "
                            "(no dropout RNG state or batch statistics)")
    for name in stacked:
        stack = getattr(model, name, None)
        if not isinstance(stack, nnx.Module):
            raise ProtocolError(f"STACKED names {name!r}, but model.{name} is not an nnx.Module")
        depths = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(nnx.state(stack, nnx.Param))}
        if len(depths) != 1 or None in depths:
            raise ProtocolError(f"model.{name} is not a stack made under nnx.vmap: its parameters' leading dims "
                                f"are {sorted(depths, key=str)}, not one layer count")
    return stacked


def as_loss_and_weight(out) -> tuple[jax.Array, jax.Array]:
    """`exit`'s result as (mean loss, weight) in fp32; the weight carries no gradient."""
    loss, weight = out if isinstance(out, tuple) else (out, 1.0)
    return jnp.asarray(loss, jnp.float32), jax.lax.stop_gradient(jnp.asarray(weight, jnp.float32))


@dataclass(frozen=True)
class Units:
    """A model as its units: graphdefs of the outer unit (the model with its stacks removed) and
    of one layer of each stack, applied to pure-dict parameters. Parameters are a dict whose
    keys are the stack names and the outer unit's top-level attributes."""

    graphdef: Any  # the whole model (for `logits` and other whole-model calls)
    outer: Any  # the model without its stacks
    layers: dict  # stack name -> graphdef of one layer
    names: tuple[str, ...]  # the stacks, in the order they run
    has_logits: bool = False  # the model has `logits(tokens, ...) -> [B, T, V]` (sampling, checks; a
    #                           vision model's takes optional extras: paligemma's pixel_values, token_type_ids)
    has_decode: bool = False  # and `decode(tokens, positions, cache) -> (logits, cache)` (a key/value cache)

    @classmethod
    def of(cls, model) -> "Units":
        names = check(model)
        layers = {name: nnx.split(getattr(model, name))[0] for name in names}
        graphdef, state = nnx.split(model)
        shell = nnx.merge(graphdef, state)  # a copy, so that `model` keeps its stacks
        for name in names:
            setattr(shell, name, None)
        return cls(graphdef, nnx.split(shell)[0], layers, names, callable(getattr(model, "logits", None)),
                   callable(getattr(model, "decode", None)))

    def outer_of(self, params: dict) -> dict:
        return {k: v for k, v in params.items() if k not in self.names}

    def enter(self, outer: dict, batch):
        return nnx.merge(self.outer, outer).enter(batch)

    def between(self, outer: dict, name: str, x, batch):
        return nnx.merge(self.outer, outer).between(name, x, batch)

    def exit(self, outer: dict, x, batch):
        """(mean loss, weight) of the rows of `batch`."""
        return as_loss_and_weight(nnx.merge(self.outer, outer).exit(x, batch))

    def block(self, name: str, layer: dict, x):
        return nnx.merge(self.layers[name], layer)(x)

    def model(self, params: dict):
        return nnx.merge(self.graphdef, params)


def apply_stack(stack, x):
    """A stack module's layers applied in order with `lax.scan` (a model's own one-device
    `logits`: sampling and checks against transformers)."""
    graphdef, stacked = nnx.split(stack)
    x, _ = jax.lax.scan(lambda x, layer: (nnx.merge(graphdef, layer)(x), None), x, stacked)
    return x


def decode_stack(stack, x, cache):
    """A stack's layers applied to new tokens with a key/value cache (generation). `cache` is
    the stack's cache from the last call (per layer {"k", "v"} [L, B, S, G, K]), or the number
    of slots S to start one (the prefill). Returns (x, the updated cache).

    Each layer's input carries the layer's cache as structure["kv"]; its attention reads it
    (`cached_kv`) and puts the updated cache back into that structure, which the layer passes on
    as it passes on every structure field (`stream`), so the cache leaves the layer with x."""
    graphdef, stacked = nnx.split(stack)
    prefill = isinstance(cache, int)

    def body(x, xs):
        layer, kv = (xs, cache) if prefill else xs
        h, structure = unstream(x)
        h, structure = unstream(nnx.merge(graphdef, layer)(stream(h, {**structure, "kv": kv})))
        kv = structure.pop("kv")
        return stream(h, structure), kv

    return jax.lax.scan(body, x, stacked if prefill else (stacked, cache))


def cached_kv(kv, k_BTGK: jax.Array, v_BTGK: jax.Array, positions_BT: jax.Array):
    """An attention's side of decoding: the new keys and values written into the cache at their
    positions (consecutive from positions_BT[:, 0], the same in every row; `kv` an int S starts
    an empty cache of S slots), and which slots each new token attends to (an attention.Mask): the
    slots up to its own position (later slots hold nothing yet, or a padded prefill's leftovers)."""
    B, T, G, K = k_BTGK.shape
    if isinstance(kv, int):
        kv = {"k": jnp.zeros((B, kv, G, K), k_BTGK.dtype), "v": jnp.zeros((B, kv, G, K), v_BTGK.dtype)}
    start = (0, positions_BT[0, 0], 0, 0)
    kv = {"k": jax.lax.dynamic_update_slice(kv["k"], k_BTGK.astype(kv["k"].dtype), start),
          "v": jax.lax.dynamic_update_slice(kv["v"], v_BTGK.astype(kv["v"].dtype), start)}
    return kv, attention.cached(positions_BT, kv["k"].shape[1])


def scan_stack(units: Units, name: str, stacked: dict, x, remat: str = "none", constrain: Callable = _identity):
    """Apply the layers of stack `name` one at a time with `lax.scan` (`remat` per layer)."""

    def body(x, layer):
        return constrain(units.block(name, layer, x)), None

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])
    x, _ = jax.lax.scan(body, x, stacked)
    return x


def forward(units: Units, params: dict, batch, remat: str = "none", constrain: Callable = _identity):
    """(mean loss, weight) of `batch` through every unit in order: the whole model as one
    function (the gspmd schedule's forward, evaluation). `constrain` is applied to the
    activations between units (a caller keeps them batch-sharded; the model knows no mesh)."""
    outer = units.outer_of(params)
    x = constrain(units.enter(outer, batch))
    for k, name in enumerate(units.names):
        if k:
            x = constrain(units.between(outer, name, x, batch))
        x = scan_stack(units, name, params[name], x, remat, constrain)
    return units.exit(outer, x, batch)


def check_factory(factory: Callable, where: str) -> None:
    """The factory can be called as factory(cfg=..., policy=..., rngs=...)."""
    try:
        inspect.signature(factory).bind(cfg=None, policy=None, rngs=None)
    except (TypeError, ValueError) as err:
        raise ProtocolError(f"{where} cannot be called as factory(cfg=..., policy=..., rngs=...) ({err})") from None


# ---------------------------------------------------------------------------------------------
# Language models: the batch contract, the activations their layers pass on, and the loss.
#
# A language model's batch is either a bare int32 token array [B, T+1] (inputs and their
# successors) or a dict of named fields, every one with the batch axis first:
#
#     tokens       int32 [B, T+1]   required: inputs tokens[:, :-1], targets tokens[:, 1:]
#     loss_mask    bool  [B, T]     target t counts in the loss (absent: every target counts);
#                                   the loss is then the mean over the unmasked targets of the
#                                   whole global batch (exit returns (masked mean, count))
#     segment_ids  int32 [B, T]     packed rows: input t attends only to inputs of its own segment
#     positions    int32 [B, T]     each input's position (absent: 0..T-1); restart per segment
#     prefix       bool  [B, T]     prefix-LM: inputs of the prefix attend to each other both
#                                   ways, the rest causally (PaliGemma's token_type_ids == 0)
#
# and whatever else a model reads (a vision model's pixel_values). Fields a model does not know
# are ignored. The activations a decoder layer passes on are the hidden states [B, T, D], or,
# when the batch has segment_ids, positions or prefix, a dict of them and those fields
# (`stream`): a block keeps them as they are and reads them through `unstream`.

STRUCTURE = ("segment_ids", "positions", "prefix")  # the fields a layer's attention reads


class Text(NamedTuple):
    """A language-model batch's fields (None where the batch has none)."""

    inputs: jax.Array  # [B, T]
    targets: jax.Array  # [B, T]
    loss_mask: jax.Array | None = None
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None
    prefix: jax.Array | None = None

    def structure(self) -> dict:
        return {k: getattr(self, k) for k in STRUCTURE if getattr(self, k) is not None}


def text(batch) -> Text:
    """The fields of a language-model batch (a bare token array, or a dict with `tokens`)."""
    if not isinstance(batch, dict):
        return Text(batch[:, :-1], batch[:, 1:])
    tokens = batch["tokens"]
    return Text(tokens[:, :-1], tokens[:, 1:], *(batch.get(k) for k in ("loss_mask", *STRUCTURE)))


def stream(h_BTD: jax.Array, structure: dict):
    """What a decoder's first layer receives: the hidden states, with the batch's structure
    fields when it has any."""
    return {**structure, "h": h_BTD} if structure else h_BTD


def unstream(x) -> tuple[jax.Array, dict]:
    """(hidden states, structure fields) of a layer's input."""
    if isinstance(x, dict):
        return x["h"], {k: v for k, v in x.items() if k != "h"}
    return x, {}


def attention_mask(structure: dict, T: int) -> jax.Array:
    """Which inputs each input attends to: bool [B or 1, T (query), T (key)]. Causal, and
    bidirectional inside the prefix, and never across segments."""
    t = jnp.arange(T)
    mask = (t[:, None] >= t[None, :])[None]
    if "prefix" in structure:
        p_BT = structure["prefix"].astype(bool)
        mask = mask | (p_BT[:, :, None] & p_BT[:, None, :])
    if "segment_ids" in structure:
        s_BT = structure["segment_ids"]
        mask = mask & (s_BT[:, :, None] == s_BT[:, None, :])
    return mask


def embed(table: nnx.Embed, ids_BT: jax.Array) -> jax.Array:
    """`table(ids_BT)` (nnx.Embed's lookup, in its dtype), whose gradient is a scatter-add
    into zeros made from the incoming gradient: jnp.take's own transpose starts from a constant
    zero table, which XLA's CPU scheduler makes at the start of the step and holds through it
    (Llama-3-8B: a 128,256 x 4,096 fp32 table, 2.1 GB, alive during the loss's backward)."""
    weights = table.embedding[...].astype(table.dtype or table.embedding.dtype)
    return _take_rows((weights.shape, weights.dtype.name), weights, ids_BT)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _take_rows(like, table_VD, ids):
    return jnp.take(table_VD, ids, axis=0)


def _take_rows_fwd(like, table_VD, ids):
    return jnp.take(table_VD, ids, axis=0), ids


def _take_rows_bwd(like, ids, g):
    shape, dtype = like
    first = g.ravel()[0].astype(jnp.float32) * 0.0  # the zeros depend on g: made when g is (see `embed`)
    zeros_VD = jnp.zeros(shape, dtype) + first.astype(dtype)
    return zeros_VD.at[ids.ravel()].add(g.reshape(-1, shape[-1]).astype(dtype)), None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def token_nll(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Next-token negative log-likelihood [B, T] in nats, computed in fp32."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]


def cross_entropy(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Mean next-token loss in nats per token."""
    return token_nll(logits_BTV, targets_BT).mean()


def text_loss(logits_BTV: jax.Array, fields: Text):
    """`exit`'s loss for a language model: the mean over every target, or, with a loss mask,
    (the mean over the unmasked targets, their number): the step's loss is then the mean over
    the global batch's unmasked targets on any mesh and any train.grad_accum."""
    if fields.loss_mask is None:
        return cross_entropy(logits_BTV, fields.targets)
    keep_BT = fields.loss_mask.astype(jnp.float32)
    count = keep_BT.sum()
    return (token_nll(logits_BTV, fields.targets) * keep_BT).sum() / jnp.maximum(count, 1.0), count


def chunked_text_loss(head: Callable, h_BTD: jax.Array, fields: Text, chunk: int):
    """`text_loss(head(h_BTD), fields)` without [B, T, V] logits: the B·T tokens in chunks of
    `chunk`, each chunk's logits and their gradient made and dropped in turn (a scan over the
    chunks under jax.checkpoint, so the backward recomputes one chunk's logits at a time; as
    levanter's blockwise cross-entropy). `head` maps hidden states [1, C, D] to fp32 logits (a
    tied head, LoRA on it: whatever the model's head is). B·T <= chunk is `text_loss` itself."""
    B, T, D = h_BTD.shape
    N = B * T
    if N <= chunk:
        return text_loss(head(h_BTD), fields)
    n_chunks = -(-N // chunk)
    keep_N = (jnp.ones((N,), jnp.float32) if fields.loss_mask is None
              else fields.loss_mask.reshape(N).astype(jnp.float32))
    pad = lambda x: jnp.pad(x, [(0, n_chunks * chunk - N)] + [(0, 0)] * (x.ndim - 1))
    h_NCD, t_NC, keep_NC = (pad(x).reshape(n_chunks, chunk, *x.shape[1:])
                            for x in (h_BTD.reshape(N, D), fields.targets.reshape(N), keep_N))

    @jax.checkpoint
    def body(total, xs):
        h_CD, t_C, keep_C = xs
        nll_C = token_nll(head(h_CD[None]), t_C[None])[0]
        return total + (nll_C * keep_C).sum(), None

    total, _ = jax.lax.scan(body, jnp.float32(0.0), (h_NCD, t_NC, keep_NC))
    if fields.loss_mask is None:
        return total / N
    count = keep_N.sum()
    return total / jnp.maximum(count, 1.0), count


def inputs(batch_BS: jax.Array) -> jax.Array:
    return batch_BS[:, :-1]


def targets(batch_BS: jax.Array) -> jax.Array:
    return batch_BS[:, 1:]
