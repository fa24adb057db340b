"""The one build step pyproject.toml cannot express: ship the lm-eval start-up hook.

``dlm_engine/integrations/lm_eval_hook.py`` is also installed as the top-level module ``dlm_engine_lm_eval_hook`` next
to a one-line ``dlm_engine_lm_eval.pth``, so that ``lm_eval --model dlm_engine`` works from lm-eval's own
command line (lm-eval has no plug-in discovery; the module's docstring explains the hook). Everything
else is configured in pyproject.toml.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HOOK_SOURCE = os.path.join("dlm_engine", "integrations", "lm_eval_hook.py")
HOOK_MODULE = "dlm_engine_lm_eval_hook"
PTH_NAME = "dlm_engine_lm_eval.pth"
PTH_LINE = f"import {HOOK_MODULE}; {HOOK_MODULE}.install()\n"


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


class BuildPyWithLmEvalHook(build_py):
    """build_py plus the hook module and .pth at the root of site-packages."""

    def _hook_dir(self) -> str:
        if getattr(self, "editable_mode", False):
            # An editable wheel ships no build_lib: files meant for site-packages go to the unpacked wheel,
            # which setuptools' editable_wheel sets as the install command's install_lib.
            return self.get_finalized_command("install").install_lib
        return self.build_lib

    def run(self):
        super().run()
        dest = self._hook_dir()
        self.mkpath(dest)
        self.copy_file(HOOK_SOURCE, os.path.join(dest, HOOK_MODULE + ".py"), preserve_mode=False)
        pth = os.path.join(dest, PTH_NAME)
        self.execute(_write_text, (pth, PTH_LINE), f"writing {pth}")

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outputs += [os.path.join(self.build_lib, HOOK_MODULE + ".py"), os.path.join(self.build_lib, PTH_NAME)]
        return outputs


setup(cmdclass={"build_py": BuildPyWithLmEvalHook})
