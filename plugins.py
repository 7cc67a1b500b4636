"""Plug-ins: what a setting may name besides the built-ins (a task, a model family, a sampler, an advantage estimator,
a policy loss), as an importable module or a .py path, and the one-line error every bad setting raises. config.py
imports from here (and re-exports SettingError)."""

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import os
import sys
from dataclasses import field

import grpo

PLUGIN_API = {  # what a task module and a model-family module provide (README: "Fork it")
    "data.task": ("load_problems", "build_prompt", "score", "VAL_METRIC", "Settings"),
    "model.family": ("MODEL_TYPES", "model_spec", "training_flops", "LORA_TARGETS"),
    "rollout.name": ("SAMPLER",),  # a class as rollout.Sampler describes
    "algorithm.adv_estimator": ("advantages",),  # as grpo.ADVANTAGE_ESTIMATORS's; optional `Settings` (--algorithm.*)
    "algorithm.loss_mode": ("policy_loss",),  # as grpo.POLICY_LOSSES's; optional `Settings` (--algorithm.*)
}
BUILT_IN = {"algorithm.adv_estimator": grpo.ADVANTAGE_ESTIMATORS, "algorithm.loss_mode": grpo.POLICY_LOSSES}
# built-in rollout.name -> its module
SAMPLERS = {"vllm": "rollout", "vllm_process": "vllm_process", "native": "native"}


class SettingError(ValueError):
    """A bad setting: its one-line message names the setting and the fix (the entry point prints it, exit 2)."""


class UnsupportedSetting(SettingError, NotImplementedError):
    """A setting titan-grpo accepts but does not implement."""


def algorithm_settings(setting: str, name: str) -> list[tuple]:
    """The fields a plug-in estimator or loss declares in its `Settings`, as make_dataclass takes them (none for a
    built-in or an unknown name: validate names the latter)."""
    if name in BUILT_IN[setting] or not (name.endswith(".py") or importable(name)):
        return []
    settings = getattr(load_plugin(setting, name), "Settings", None)
    if settings is None:
        return []
    return [(f.name, f.type, field(default=f.default) if f.default is not dataclasses.MISSING
             else field(default_factory=f.default_factory)) for f in dataclasses.fields(settings)]


def algorithm_function(setting: str, name: str):
    """The advantage estimator or policy loss an algorithm setting names: built in (grpo.py) or a plug-in's."""
    if name in BUILT_IN[setting]:
        return BUILT_IN[setting][name]
    return getattr(load_algorithm_plugin(setting, name), PLUGIN_API[setting][0])


def load_algorithm_plugin(setting: str, name: str):
    """The module an algorithm setting names (a .py path or an importable module), else a one-line SettingError."""
    if not (name.endswith(".py") or importable(name)):
        raise SettingError(f"{setting}={name!r} is unknown; use one of {tuple(BUILT_IN[setting])} or a module / .py "
                           f"path providing {PLUGIN_API[setting][0]}")
    return load_plugin(setting, name)


@functools.cache  # one module object per name: a .py file runs once
def load_plugin(setting: str, name: str):
    """The module a plug-in setting (data.task, model.family, rollout.name) names: an importable name or a .py
    file's path (registered in sys.modules under its file name, as an import would, so that its classes resolve)."""
    try:
        if name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(os.path.basename(name)[:-3], os.path.abspath(name))
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(name)
    except (ImportError, FileNotFoundError) as error:
        raise SettingError(f"{setting}={name} cannot be loaded ({error}); give a module name or a .py path") from None
    missing = [attr for attr in PLUGIN_API[setting] if not hasattr(module, attr)]
    if missing:
        raise SettingError(f"{setting}={name} lacks {', '.join(missing)}; such a module provides "
                           f"{', '.join(PLUGIN_API[setting])}")
    return module


def sampler_class(cfg):
    """The rollout.Sampler class rollout.name names (a built-in name, a module or a .py path)."""
    return load_plugin("rollout.name", SAMPLERS.get(cfg.rollout.name, cfg.rollout.name)).SAMPLER


def importable(module: str) -> bool:
    """Whether `module` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


@contextlib.contextmanager
def one_line_errors():
    """A SettingError inside ends the process with its one line on stderr and exit code 2, no traceback; the line
    also goes to the file TITAN_GRPO_REFUSAL names, if set (run.sh repeats it last after torchrun ends)."""
    try:
        yield
    except SettingError as error:
        print(f"titan-grpo: {error}", file=sys.stderr, flush=True)
        if os.environ.get("TITAN_GRPO_REFUSAL"):
            with open(os.environ["TITAN_GRPO_REFUSAL"], "a") as f:
                f.write(f"titan-grpo: {error}\n")
        sys.exit(2)
