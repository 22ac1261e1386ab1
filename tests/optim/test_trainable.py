"""train.trainable: frozen parameters stay bit-identical and hold no optimizer state
(sharenet/optim/trainable.py)."""
import os

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from sharenet.errors import ConfigError

LORA = {'model.num_layers': 4, 'model.sharing.scheme': 'cycle', 'model.sharing.num_unique': 2,
        'model.sharing.lora_rank': 4}


def _checkpoint_leaves(workdir, step):
  """{'/'-joined path: shape} of every array the checkpoint's train state holds."""
  import orbax.checkpoint as ocp
  meta = ocp.StandardCheckpointer().metadata(os.path.join(workdir, 'checkpoints', str(step),
                                                          'state'))
  tree = getattr(meta, 'item_metadata', meta)
  tree = getattr(tree, 'tree', tree)
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out['/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k))))
                 for k in path)] = tuple(getattr(leaf, 'shape', ()))
  return out


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['adamw', 'mup'])
def test_lora_only_leaves_the_base_bit_identical_without_optimizer_state(tmp_path, tiny_config,
                                                                         kind):
  from sharenet.train import loop, trainer, workdir_io
  over = {**LORA, 'train.steps': 10, 'train.checkpoint_every': 10, 'train.trainable': 'lora'}
  if kind == 'mup':
    over.update({'parametrization.kind': 'mup', 'parametrization.base_d_model': 16})
  config = tiny_config(**over)
  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(config, workdir)
  restored = workdir_io.restore_state(workdir_io.load_config(workdir), workdir)
  model, tx, pz, tr = restored.exp
  init = trainer.init_state(model, tx, jax.random.key(config.train.seed), tr, pz)
  moved = []
  for path, after in flatten_dict(restored.state.params).items():
    before = flatten_dict(init.params)[path]
    same = np.array_equal(np.asarray(after), np.asarray(before))
    if 'lora_a' in path[-1] or 'lora_b' in path[-1]:
      moved.append(not same)
    else:
      assert same, path   # a base parameter: bit-identical after 10 steps
  assert moved and any(moved)
  opt = {k: v for k, v in _checkpoint_leaves(workdir, 10).items() if k.startswith('opt_state')}
  moments = [k for k in opt if v_shape(opt[k])]
  assert moments and all('lora' in k for k in moments), moments


def v_shape(shape):
  return len(shape) > 0


@pytest.mark.slow
def test_the_optimizer_of_a_trainable_subset_keeps_the_rules_of_its_leaves(tiny_config):
  """muP's per-leaf rules: the LoRA leaves' update under trainable=lora equals their update
  under trainable=all (same gradients), and the frozen leaves' update is zero."""
  import jax.numpy as jnp
  from sharenet.train import experiment, trainer
  cfgs = {s: tiny_config(**{**LORA, 'parametrization.kind': 'mup',
                            'parametrization.base_d_model': 16, 'train.trainable': s})
          for s in ('all', 'lora')}
  exps = {s: trainer.setup(experiment.sections(c)) for s, c in cfgs.items()}
  state = trainer.init_state(*exps['all'][:2], jax.random.key(0), exps['all'].tr,
                             exps['all'].pz)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), state.params)
  ups = {}
  for s, e in exps.items():
    ups[s], _ = e.tx.update(grads, e.tx.init(state.params), state.params)
  for path, u in flatten_dict(ups['lora']).items():
    if 'lora' in path[-1]:
      np.testing.assert_array_equal(np.asarray(u), np.asarray(flatten_dict(ups['all'])[path]))
    else:
      assert not np.asarray(u).any(), path


@pytest.mark.parametrize('spec, match', [
    ('lora', 'matches no parameter'),          # the tiny model has no LoRA
    ('no_such_path', 'matches no parameter'),
    ('(', 'neither'),
])
def test_a_spec_that_trains_nothing_is_one_line_and_writes_nothing(tmp_path, tiny_config, spec,
                                                                   match):
  from sharenet.train import loop
  with pytest.raises(ConfigError, match=match) as e:
    loop.train_and_evaluate(tiny_config(**{'train.trainable': spec}), str(tmp_path / 'run'))
  assert '\n' not in str(e.value) and not (tmp_path / 'run').exists()
