"""Copies the top-level rules/ folder into the wheel as kvdoctor/_rules.

rules/ stays at the top of the repository, where people edit and review it; a non-editable
install must still find it, so the build step carries it into the package.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithRules(build_py):
    def run(self):
        super().run()
        src = Path(__file__).parent / "rules"
        dst = Path(self.build_lib) / "kvdoctor" / "_rules"
        dst.mkdir(parents=True, exist_ok=True)
        for rule in sorted(src.glob("*.yaml")):
            shutil.copy2(rule, dst / rule.name)


setup(cmdclass={"build_py": BuildWithRules})
