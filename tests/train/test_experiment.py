"""The experiment config is read once, at the top (train/experiment.py): a training run, fresh
and resumed, reads the ConfigDict only in the train loop, the resolution into typed sections,
the typed sections' own constructors and the config package; every module below receives the
sections."""
import sys

import ml_collections
import pytest

from sharenet.config import sections
from sharenet.errors import ConfigError
from sharenet.train import experiment, loop

# Modules that may read the experiment's ConfigDict: the loop and the resolution at the top.
READERS = ('sharenet.train.loop', 'sharenet.train.experiment')
# Frames between a reader and the ConfigDict, which read on their caller's behalf: the library
# and what it calls, the config package (defaults, migrations, the compatibility table) and the
# typed model section's and parametrization group's constructors.
PASS_THROUGH = ('ml_collections', 'copy', 'json', 'contextlib', 'sharenet.config.',
                'sharenet.models.config', 'sharenet.models.scaling', __name__)
# Every way to read a ConfigDict's keys.
READS = ('__getattr__', '__getitem__', '__contains__', '__iter__', 'get', 'items', 'keys',
         'values', 'to_dict')


class Watch:
  """Records the module of every read of one ConfigDict (and its groups)."""

  def __init__(self, config: ml_collections.ConfigDict):
    self.ids, self.readers = set(), set()
    self._mark(config)

  def _mark(self, node):
    self.ids.add(id(node))
    for value in node.values():
      if isinstance(value, ml_collections.ConfigDict):
        self._mark(value)

  def record(self, node):
    if id(node) not in self.ids:
      return
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get('__name__', '').startswith(PASS_THROUGH):
      frame = frame.f_back
    if frame is not None:
      self.readers.add(frame.f_globals.get('__name__', ''))

  def install(self, monkeypatch):
    for name in READS:
      original = getattr(ml_collections.ConfigDict, name)

      def watched(node, *args, _original=original, **kwargs):
        self.record(node)
        return _original(node, *args, **kwargs)

      monkeypatch.setattr(ml_collections.ConfigDict, name, watched)


def below_the_loop(readers):
  return sorted(r for r in readers if r.startswith('sharenet') and not r.startswith(READERS))


@pytest.mark.slow
def test_no_module_below_the_train_loop_reads_the_config_dict(tiny_config, tmp_path,
                                                              monkeypatch):
  config = tiny_config(**{'train.steps': 2, 'train.eval_every': 2, 'train.checkpoint_every': 2})
  watch = Watch(config)
  watch.install(monkeypatch)
  loop.train_and_evaluate(config, str(tmp_path))
  config.unlock()
  config.train.steps = 3                         # resumed: restore, continue, evaluate
  loop.train_and_evaluate(config, str(tmp_path))
  assert 'sharenet.train.experiment' in watch.readers   # the watch sees the resolution
  assert below_the_loop(watch.readers) == []


def test_the_watch_names_a_module_that_reads_the_config(tiny_config, monkeypatch):
  config = tiny_config()
  watch = Watch(config)
  watch.install(monkeypatch)
  from sharenet.optim import chain
  chain.lr_schedule(config.train)   # a module below the loop, handed the raw group
  assert below_the_loop(watch.readers) == ['sharenet.optim.chain']
  watch.readers.clear()
  from sharenet.data import corpus   # reading through a config helper names the caller
  corpus.get_field(config.data, 'source')
  assert below_the_loop(watch.readers) == ['sharenet.data.corpus']
  watch.readers.clear()
  chain.lr_schedule(experiment.sections(config).train)
  assert below_the_loop(watch.readers) == []


def test_sections_are_the_defaults_keys_typed(tiny_config):
  config = tiny_config(**{'train.lr': 0.01, 'mesh.rules': [['embed', 'fsdp']]})
  run = experiment.sections(config)
  assert isinstance(run.train, sections.TrainConfig) and run.train.lr == 0.01
  assert run.train.muon.scale == config.train.muon.scale
  assert run.mesh.rules == (('embed', 'fsdp'),)   # lists frozen into tuples
  assert set(run.train.keys()) == set(config.train.keys())
  assert run.record['train']['lr'] == 0.01
  with pytest.raises(ConfigError, match='train.lrr is not a config key; valid: '):
    sections.read(sections.TrainConfig, {'lrr': 1.0}, 'train')
  old = sections.read(sections.DataConfig, {'source': 'stdlib'}, 'data')   # an older workdir
  assert old.eval_tokens == sections.DataConfig().eval_tokens


def test_a_model_config_of_another_parametrization_is_one_line(tiny_config):
  from sharenet.models import ModelConfig
  config = tiny_config(**{'parametrization.kind': 'mup'})
  with pytest.raises(ConfigError, match='is not the experiment'):
    experiment.sections(config, ModelConfig.from_config(config.model, 16))
