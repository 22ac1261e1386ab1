"""MASA: matrix atoms shared by every applied layer (Zhussip, Shopkhoev, Ali, Lefkimmiatis,
"Share Your Attention: Transformer Weight Sharing via Matrix-based Dictionary Learning",
arXiv:2508.04581).

For each target kernel type p (model.masa.targets; the paper's q, k, v, o by default) the model
stores S = model.masa.atoms full-size atoms D_p,s, and every stored set l stores S coefficients
c_p,l: W_p,l = sum_s c_p,l,s D_p,s (models/layers.py Dense with `atoms`). Followed from the
paper's abstract: one dictionary per projection type, each layer's weight a linear combination
of full-size matrix atoms, trained end to end with the model's optimizer. The paper's choice of
S (its 66.7% saving of attention parameters corresponds to S = L/3 full-size atoms) is left to
the config; the coefficient init is ours (not verified against the paper): a random unit vector
per set, with atoms drawn at the kernel's default std, so W_l starts at the default init's scale.

The atoms are 'params' of DecoderLM ('masa/<kernel name>': q, k, v, o, wi | wi_gate, wi_up, wo),
outside the layer stack, so they are
stored once whatever the sharing plan; DecoderLM hands them to the Stack, which broadcasts them
into every scan level (models/stack.py) down to the Dense that combines them. The coefficients
live inside the blocks and follow the plan (tied sets share them).

Roles (sharenet/models/params.py): an atom has its kernel's role (reader / writer, so muP treats it
as
the hidden matrix it builds: same fan-in, fan-out, init and LR rules) and a leading 'atoms' axis,
a stack axis that is never width. The coefficients are role 'scalar' (muP 'vector'): a change of
c by Theta(eta) changes W x by Theta(eta) relative to W x at any width, like a norm gain.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sharenet.models.config import ModelConfig
from sharenet.models.params import param

ATOMS = 'atoms'   # logical axis of the dictionary index (a stack axis, never width)


def atom_specs(cfg: ModelConfig, targets: tuple[str, ...] | None = None) -> dict[str, tuple]:
  """{kernel name: (kernel shape, kernel axes, role, num_in, branch, use)} of the kernels the
  MASA targets name (or `targets`: the parameter bank's, models/bank.py): 'mlp_in' is the MLP's
  input kernels (SwiGLU: wi_gate and wi_up, one dictionary each, as each is its own projection
  type), 'mlp_out' its 'wo'."""
  D, H, K, Dh, F = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.d_head, cfg.mlp_dim
  mlp_in = ('wi_gate', 'wi_up') if cfg.mlp in ('swiglu', 'geglu') else ('wi',)
  kernels = {'q': ('q',), 'k': ('k',), 'v': ('v',), 'o': ('o',), 'mlp_in': mlp_in,
             'mlp_out': ('wo',)}
  reader = lambda axes_out, shape_out, branch, use=None: (
      (D,) + shape_out, ('embed',) + axes_out, 'reader', 1, branch, use)
  specs = {
      'q': reader(('heads', 'head_dim'), (H, Dh), 'attn', 'query'),
      'k': reader(('kv_heads', 'head_dim'), (K, Dh), 'attn', 'key'),
      'v': reader(('kv_heads', 'head_dim'), (K, Dh), 'attn'),
      'o': ((H, Dh, D), ('heads', 'head_dim', 'embed'), 'writer', 2, 'attn', None),
      'wo': ((F, D), ('mlp', 'embed'), 'writer', 1, 'mlp', None),
  }
  for name in ('wi', 'wi_gate', 'wi_up'):
    specs[name] = reader(('mlp',), (F,), 'mlp')
  targets = cfg.atom_kernels if targets is None else targets
  return {k: specs[k] for t in targets for k in kernels[t]}


class MasaAtoms(nn.Module):
  """Creates the atoms of every target kernel: returns {kernel name: (S, kernel shape...)}."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self) -> dict[str, jax.Array]:
    c = self.cfg
    out = {}
    for name, (shape, axes, role, num_in, branch, use) in atom_specs(c).items():
      fan_in = 1
      for n in shape[:num_in]:
        fan_in *= n
      out[name] = param(self, name, (c.masa.atoms,) + shape, (ATOMS,) + axes, role,
                          std=fan_in ** -0.5, dtype=jnp.dtype(c.param_dtype), num_in=num_in,
                          branch=branch, writes=role == 'writer', use=use)
    return out
