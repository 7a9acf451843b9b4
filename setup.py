"""Everything is in pyproject.toml except one computed path: ``ecache_lm_eval.pth`` goes to
site-packages (purelib), written relative to the data scheme as wheels require, so that
``lm_eval --model ecache`` finds the model on lm-eval releases without plugin discovery
(ecache_cli/evaluation/hook.py). Regular and editable (``pip install -e``) installs both carry it."""

import os
import sysconfig

from setuptools import setup
from setuptools.dist import Distribution

SITE = os.path.relpath(sysconfig.get_path("purelib"), sysconfig.get_path("data"))


class EditableDataDistribution(Distribution):
    """setuptools' editable_wheel installs data files only if ``dist.has_data()`` exists and is true
    (setuptools/command/editable_wheel.py ``_run_install("data")``), but Distribution names it
    ``has_data_files``; this alias lets ``pip install -e`` install the .pth too."""

    def has_data(self) -> bool:
        return self.has_data_files()


setup(data_files=[(SITE, ["ecache_cli/evaluation/ecache_lm_eval.pth"])], distclass=EditableDataDistribution)
