"""What a run shows while it runs (sharenet/train/loop.py, profile.py): the progress bar's labels
between steps, and a profiler trace of chosen steps."""
import pytest


@pytest.mark.slow
def test_the_bar_names_compiling_evaluating_saving_and_the_end(tmp_path, tiny_config, capfd):
  from sharenet.train import loop
  config = tiny_config(**{'train.steps': 4, 'train.eval_every': 2, 'train.checkpoint_every': 2,
                          'train.progress': True})
  loop.train_and_evaluate(config, str(tmp_path / 'run'))
  err = capfd.readouterr().err
  labels = ['compiling the train step', 'train', 'evaluating', 'saving a checkpoint',
            'final evaluation', 'writing the last checkpoint']
  at = [err.find(label + ':') for label in labels]
  assert all(i >= 0 for i in at), dict(zip(labels, at))
  assert at[0] < at[2] < at[4] < at[5] and at[3] < at[4]
  # the last label is the bar's final state
  assert err.rfind('writing the last checkpoint:') > err.rfind('final evaluation:')


def test_profile_steps_write_a_trace_naming_the_train_step(tmp_path, tiny_config):
  """train.profile.steps=2:3: DIR/profile holds one xplane trace whose events name the
  train_step annotation of steps 2 and 3 (sharenet/train/profile.py)."""
  import glob
  import os
  from sharenet.train import loop
  workdir = str(tmp_path / 'run')
  loop.train_and_evaluate(tiny_config(**{'train.steps': 5, 'train.profile.steps': '2:3'}),
                          workdir)
  (trace,) = glob.glob(os.path.join(workdir, 'profile', 'plugins', 'profile', '*',
                                    '*.xplane.pb'))
  raw = open(trace, 'rb').read()
  assert b'train_step' in raw and b'jit_' in raw


def test_bad_profile_ranges_are_one_line(tmp_path, tiny_config):
  from sharenet.errors import ConfigError
  from sharenet.train import loop
  for spec, match in (('3:9', 'outside the run; valid: START:END with 1 <= START <= END <= '
                              'train.steps=5'), ('0:2', 'outside the run'), ('4:2', 'outside'),
                      ('2-3', 'is not START:END')):
    with pytest.raises(ConfigError, match=match) as e:
      loop.train_and_evaluate(tiny_config(**{'train.steps': 5, 'train.profile.steps': spec}),
                              str(tmp_path / 'run'))
    assert '\n' not in str(e.value) and not (tmp_path / 'run').exists()


@pytest.mark.slow
def test_kill_and_resume_is_exact_while_watching_logging_and_profiling(tmp_path, monkeypatch):
  """train.watch (on a cycle: per-use rows too), the W&B logger (offline) and a profiler trace
  change no state: a run with all three on, killed with -9 after its step-4 checkpoint,
  resumes to the uninterrupted losses. The runs inherit WANDB_SERVICE from this process (a
  launcher using wandb): each train.py starts its own service, so the killed run's W&B stream
  dies with it and the rerun resumes the W&B run."""
  pytest.importorskip('wandb')
  from conftest import resume_matches_uninterrupted, share_a_wandb_service
  share_a_wandb_service(tmp_path, monkeypatch)
  ref, _ = resume_matches_uninterrupted(tmp_path, [
      '--config.train.steps=8', '--config.train.checkpoint_every=4',
      '--config.train.log_every=1', '--config.train.watch=True',
      '--config.model.sharing.scheme=cycle', '--config.model.sharing.num_unique=1',
      '--config.train.loggers=jsonl,tensorboard,wandb', '--config.train.profile.steps=2:3'], 4, 8)
  from sharenet.train.metrics import read_metrics
  rows = [r for r in read_metrics(ref) if 'loss' in r]
  assert len(rows) == 8 and all('watch/use_grad_share/writer/layer1' in r for r in rows)
