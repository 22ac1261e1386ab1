"""The progress bar says what a run does when it is not stepping (sharenet/train/loop.py)."""


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
