"""Every notebook in colabs/ runs top to bottom (code cells executed in one namespace)."""
import glob
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize('path', sorted(glob.glob(os.path.join(ROOT, 'colabs', '*.ipynb'))))
def test_notebook_runs(path):
  nb = json.load(open(path))
  namespace = {}
  for cell in nb['cells']:
    if cell['cell_type'] != 'code':
      continue
    src = ''.join(cell['source'])
    exec(compile(src, path, 'exec'), namespace)  # noqa: S102 - our own notebooks
  assert namespace['out']['eval_bits_per_byte'] > 0
