"""Every notebook in colabs/ runs top to bottom in a real Jupyter kernel (nbclient + ipykernel).

Each notebook runs at its SMALL size (the environment variable SHARENET_COLAB_SMALL=1, read by
its setup cell), with the repository on the kernel's PYTHONPATH (so its install cell finds
sharenet and installs nothing) and the suite's persistent compilation cache. A notebook that
plots must leave at least one PNG among its outputs; committed notebooks carry no outputs.
"""
import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

import conftest
from sharenet.config.cli import GC_THRESHOLDS

ROOT = conftest.ROOT
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, 'colabs', '*.ipynb')))
TIMEOUT_S = 300   # per cell


def _uses_matplotlib(nb):
  return any('matplotlib' in c.source or 'plt.' in c.source for c in nb.cells
             if c.cell_type == 'code')


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_committed_without_outputs(path):
  nb = nbformat.read(path, as_version=4)
  nbformat.validate(nb)
  for cell in nb.cells:
    if cell.cell_type == 'code':
      assert not cell.outputs and cell.execution_count is None, (
          f'{os.path.basename(path)}: clear the outputs before committing')


@pytest.mark.slow
@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
  env = conftest.make_subprocess_env()
  env.update(SHARENET_COLAB_SMALL='1', SHARENET_COLAB_WORKDIR=str(tmp_path), JAX_PLATFORMS='cpu')
  # The kernel's collector runs at the entry points' thresholds (cli.GC_THRESHOLDS), set
  # by an IPython startup file: the notebooks' cells are run as committed.
  startup = tmp_path / 'ipython' / 'profile_default' / 'startup'
  startup.mkdir(parents=True)
  (startup / '00-gc.py').write_text(f'import gc\ngc.set_threshold(*{GC_THRESHOLDS})\n')
  env['IPYTHONDIR'] = str(tmp_path / 'ipython')
  for k, v in env.items():   # the kernel is started with this process's environment
    monkeypatch.setenv(k, v)
  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name='python3',
                          resources={'metadata': {'path': str(tmp_path)}})
  client.execute()   # raises CellExecutionError on the first failing cell
  images = [o for c in nb.cells if c.cell_type == 'code' for o in c.outputs
            if 'image/png' in o.get('data', {})]
  if _uses_matplotlib(nb):
    assert images, f'{os.path.basename(path)} plots but produced no image/png output'
  errors = [o for c in nb.cells if c.cell_type == 'code' for o in c.outputs
            if o.output_type == 'error']
  assert not errors
