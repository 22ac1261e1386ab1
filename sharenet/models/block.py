"""Transformer block with pre / post / peri / moeut norm placement.

moeut is MoEUT's peri-layernorm (Csordas et al., arXiv:2405.16039; reference code moeut.py
MoEUTLayer): a norm only before the linear maps a softmax or sigmoid reads, so the
residual stream itself is read un-normalised elsewhere:

  x <- x + attn(q, k from N_a(x); v from x)       (SwitchHead: value selector from N_a(x))
  x <- x + ffn(x; its selector from N_m(x))       (dense MLP: x + MLP(x), no norm)

and the final norm before the readout, as the reference's out_norm.

Under u-muP (`cfg.umup_residual` = (alpha_attn, alpha_mlp), set by the parametrization) each
branch is applied as u-muP's residual_split / residual_add with the tau of its index among the
applied branches (arXiv:2407.17465 Appendix G, unit_scaling.core.functional
.transformer_residual_scaling_rule): x <- (x + tau f(x)) / sqrt(1 + tau^2), so the stream stays
unit scale. The carry is then (x, applied layer index): shared sets applied several times get
one tau per application, i.e. the rule counts applied layers as u-muP's TransformerStack counts
its slots.

Every norm follows model.kernels. Where that selects the Pallas kernels, the pre-norm block
fuses the attention branch's residual add with the MLP norm (x, h = mlp_norm(x, attn_out):
sharenet/kernels/norms.py), one pass over the stream instead of two.
"""
from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharenet.models.attention import BRANCH as ATTN, CausalAttention, DecodeStep, LayerCache
from sharenet.models.config import ModelConfig
from sharenet.models.layers import sow_l1, sow_rms
from sharenet.models.mlp import BRANCH as MLP, Mlp
from sharenet.models.moe import MoeFfn
from sharenet.models import unit_scale
from sharenet import kernels as kernel_lib
from sharenet.kernels import norms as norm_kernels
from sharenet.models.norms import Norm
from sharenet.models.params import PER_LAYER
from sharenet.models.params import placed

ACT_AXES = ('activation_batch', 'activation_length', 'activation_embed')


class Stream(NamedTuple):
  """The carry of the layer scans: the residual stream, the applied layer index that u-muP's
  residual rule and sliced loops (model.loop_slices) read (None otherwise: a pass without it,
  such as the exits' pass through the coda, attends in full), and the summed weighted aux
  losses of model.moe's experts (a float32 scalar where a training or evaluation pass collects
  them, models/moe.py; None otherwise). Riding in the carry, the aux loss passes through every
  lowering of the loop runner as the stream does."""
  x_BTD: jax.Array
  layer: jax.Array | None = None
  aux: jax.Array | None = None


class Shared(NamedTuple):
  """What every applied layer of a scan reads (broadcast)."""
  positions_T: jax.Array | None              # None in cached generation: positions are the step's
  segment_ids_BT: jax.Array | None = None    # packed documents
  step: DecodeStep | None = None             # cached generation
  masa: dict[str, jax.Array] | None = None   # MASA atoms {target: atoms}, models/masa.py
  # a looped segment run at another depth: R / (the loops run), the Euler step of
  # model.recurrence.ode_step (None: the plan's depth, step 1)
  step_size: jax.Array | float | None = None


class Scanned(NamedTuple):
  """What each applied layer of a scan reads its own entry of (sliced on the leading axis)."""
  cache: LayerCache | None = None            # this layer's KV cache (cached generation)
  shared_kv: LayerCache | None = None        # model.kv_sharing=first: the first loop's keys
                                             # and values, attended to instead of its own


class Block(nn.Module):
  """One layer, the body of nn.scan: (Stream, Shared, Scanned) -> (Stream, updated cache).

  The stream's layer index counts applied layers under u-muP's residual rule. With a cache in
  `scanned` (this applied layer's LayerCache, models/attention.py) and the step in `shared`,
  the updated cache comes back (nn.scan stacks them, one per applied layer); None otherwise.
  The MASA atoms in `shared` are handed to the attention and the MLP.

  model.kv_sharing=first (models/loops.py): with `emit_kv` the block returns its attention's
  keys and values in the cache's place (a LayerCache of the call's tokens) when it has no cache;
  with `shared_kv` in `scanned` it attends to those instead of its own.
  """
  cfg: ModelConfig
  emit_kv: bool = False

  @nn.compact
  def __call__(self, carry: Stream, shared: Shared, scanned: Scanned = Scanned()
               ) -> tuple[Stream, LayerCache | None]:
    with placed(block=tuple(self.path)):   # structure metadata: block-local keys (params.py)
      return self._layer(carry, shared, scanned.cache, scanned.shared_kv)

  def _layer(self, carry: Stream, shared: Shared, cache: LayerCache | None,
             shared_kv: LayerCache | None):
    positions_T, segment_ids_BT, step, masa = shared[:4]
    c = self.cfg
    updated = []   # the attention's updated cache, when given one
    # model.recurrence.ode_step: x <- x + h f(x), h = R / n at n loops (pre / moeut placement)
    h = shared.step_size if c.recurrence.ode_step else None
    euler = (lambda y: y) if h is None else (lambda y: y * jnp.asarray(h, y.dtype))

    def norm(name, branch, role='norm_in'):
      return Norm(c.norm.kind, c.norm.eps, PER_LAYER if c.sharing.untie_norms else 'params',
                  param_dtype=jnp.dtype(c.param_dtype), dyt_alpha=c.norm.dyt_alpha, role=role,
                  p=c.norm.p, branch=branch, kernels=c.kernels,
                  stats=c.norm, name=name)

    a, m = ATTN, MLP

    attention = CausalAttention(c, name='attn')
    auxes = []   # model.moe: each application's weighted aux loss, added to the carry's
    ffn = self._feed_forward(masa, auxes)
    mlp = ffn if h is None else lambda *args: euler(ffn(*args))
    selects = c.moe.kind != 'none' or c.moe.lora_experts > 0   # the feed-forward has a router

    # model.loop_slices: this applied layer's slicing, an index into (full, *c.slice_lens)
    slices = None
    if c.slice_lens and carry.layer is not None:
      table = jnp.asarray(c.slice_branch, jnp.int32)
      slices = table[jnp.minimum(carry.layer, len(c.slice_branch) - 1)]

    def attn(h_BTD, positions_T, segment_ids_BT, value_in_BTD=None):
      out = attention(h_BTD, positions_T, segment_ids_BT, cache, step, masa, shared_kv,
                      self.emit_kv, value_in_BTD, auxes, slices)
      if isinstance(out, tuple):   # (out, the updated cache or the emitted keys and values)
        updated.append(out[1])
        return euler(out[0])
      return euler(out)

    if c.umup_residual:                # u-muP: pre or peri (post rejected by the parametrization)
      x_BTD, layer = carry.x_BTD, carry.layer
      if c.norm.placement == 'pre':
        f_attn = lambda x: attn(norm('attn_norm', a)(x), positions_T, segment_ids_BT)
        f_mlp = lambda x: mlp(norm('mlp_norm', m)(x))
      else:
        f_attn = lambda x: norm('attn_out_norm', a, 'norm_out')(
            attn(norm('attn_norm', a)(x), positions_T, segment_ids_BT))
        f_mlp = lambda x: norm('mlp_out_norm', m, 'norm_out')(mlp(norm('mlp_norm', m)(x)))
      for i, f in ((2 * layer, f_attn), (2 * layer + 1, f_mlp)):
        tau = unit_scale.residual_tau(i, c.num_layers, c.umup_residual)
        x_BTD = unit_scale.residual_apply(f, x_BTD, tau).astype(x_BTD.dtype)
      sow_l1(self, 'residual', x_BTD)
      sow_rms(self, 'residual', x_BTD)
      x_BTD = nn.with_logical_constraint(x_BTD, ACT_AXES)
      return carry._replace(x_BTD=x_BTD, layer=layer + 1), (updated or [None])[0]
    x_BTD = carry.x_BTD
    fuse = c.norm.kind in norm_kernels.KINDS and kernel_lib.use_pallas(c.kernels)
    if c.norm.placement == 'pre' and fuse:   # the same, the first add fused with the MLP norm
      attn_BTD = attn(norm('attn_norm', a)(x_BTD), positions_T, segment_ids_BT)
      x_BTD, h_BTD = norm('mlp_norm', m)(x_BTD, attn_BTD)
      x_BTD = x_BTD + mlp(h_BTD)
    elif c.norm.placement == 'pre':    # x + f(N(x))
      x_BTD = x_BTD + attn(norm('attn_norm', a)(x_BTD), positions_T, segment_ids_BT)
      x_BTD = x_BTD + mlp(norm('mlp_norm', m)(x_BTD))
    elif c.norm.placement == 'post':   # N(x + f(x))
      x_BTD = norm('attn_norm', a)(x_BTD + attn(x_BTD, positions_T, segment_ids_BT))
      x_BTD = norm('mlp_norm', m)(x_BTD + mlp(x_BTD))
    elif c.norm.placement == 'moeut':  # norms only where a softmax / sigmoid reads
      x_BTD = x_BTD + attn(norm('attn_norm', a)(x_BTD), positions_T, segment_ids_BT, x_BTD)
      x_BTD = x_BTD + mlp(x_BTD, norm('mlp_norm', m)(x_BTD) if selects else None)
    else:                              # peri: x + N_out(f(N_in(x)))
      x_BTD = x_BTD + norm('attn_out_norm', a, 'norm_out')(
          attn(norm('attn_norm', a)(x_BTD), positions_T, segment_ids_BT))
      x_BTD = x_BTD + norm('mlp_out_norm', m, 'norm_out')(mlp(norm('mlp_norm', m)(x_BTD)))
    sow_l1(self, 'residual', x_BTD)
    sow_rms(self, 'residual', x_BTD)
    if carry.aux is not None and auxes:
      carry = carry._replace(aux=carry.aux + sum(auxes))
    if carry.layer is not None:
      carry = carry._replace(layer=carry.layer + 1)
    return carry._replace(x_BTD=nn.with_logical_constraint(x_BTD, ACT_AXES)), \
        (updated or [None])[0]

  def _feed_forward(self, masa: dict[str, jax.Array] | None, auxes: list):
    """The feed-forward branch (h, select_BTD=None) -> f(h): the dense MLP (with the MASA
    atoms), or under model.moe the experts, whose aux loss is appended to `auxes`. `select_BTD`
    (model.norm.placement=moeut): what its router reads instead of h (the normed stream)."""
    if self.cfg.moe.kind == 'none':
      mlp_module = Mlp(self.cfg, name='mlp')
      return lambda h_BTD, select_BTD=None: mlp_module(h_BTD, masa, select_BTD)
    moe_module = MoeFfn(self.cfg, name='moe')

    def experts(h_BTD, select_BTD=None):
      out, aux = moe_module(h_BTD, select_BTD)
      auxes.append(aux)
      return out
    return experts
