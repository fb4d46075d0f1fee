"""Samplers run without torch (issue 31: the torch-free sampler image): with ``sampler.inference`` auto a CNN policy
runs in onnxruntime from a graph built without torch, the MLP in numpy, and a sampler that asks for torch inference
where torch is not installed stops at start in one line naming the extra. Each check runs in a subprocess whose
``import torch`` fails (``sys.modules['torch'] = None``), as in the sampler image; the log-probabilities it computes
are compared here with the trainer's torch model on the same weights."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.fragment import FragmentSpec
from shared.rl.model import ActorCritic, weights_to_bytes

REPO = Path(__file__).resolve().parents[2]
NO_TORCH = "import sys; sys.modules['torch'] = None\n"

SPECS = {
    "minatar": FragmentSpec(obs_shape=(10, 10, 4), num_actions=3, max_bytes=1 << 22, env_id="MinAtar/Breakout-v1",
                            obs_dtype="uint8", frame_stack=2),
    "pong": FragmentSpec(obs_shape=(84, 84), num_actions=6, max_bytes=1 << 22, env_id="ALE/Pong-v5",
                         obs_dtype="uint8", frame_stack=4),
    "chw": FragmentSpec(obs_shape=(3, 40, 40), num_actions=5, max_bytes=1 << 22, env_id="chw", obs_dtype="uint8"),
    "mlp": FragmentSpec(obs_shape=(4,), num_actions=2, max_bytes=1 << 22, env_id="CartPole-v1"),
}


def _run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], cwd=REPO, capture_output=True, text=True,
                          timeout=240, env={**os.environ, **(env or {})}, check=False)


def test_blocking_torch_in_the_subprocess_works() -> None:
    out = _run("import torch")
    assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr


def test_onnx_policies_load_and_act_without_torch_as_the_torch_model_does(tmp_path: Path) -> None:
    cases = {}
    for name, spec in SPECS.items():
        torch.manual_seed(len(name))
        model = ActorCritic.for_spec(spec, 64, model="auto")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)  # far from uniform: the heads start near zero
        rows = 5
        shape = (rows, spec.frame_stack, *spec.obs_shape) if spec.obs_dtype == "uint8" else (rows, 4)
        rng = np.random.default_rng(0)
        obs = (rng.integers(0, 256, shape).astype(np.uint8) if spec.obs_dtype == "uint8"
               else rng.normal(size=shape).astype(np.float32))
        (tmp_path / f"{name}.st").write_bytes(weights_to_bytes(model))
        np.save(tmp_path / f"{name}.npy", obs)
        with torch.no_grad():
            want = model.log_probs(torch.from_numpy(obs).float() if obs.dtype == np.float32
                                   else torch.from_numpy(obs)).numpy()
        cases[name] = (spec, want)
    code = f"""
import json, pathlib
import numpy as np
from shared.fragment import FragmentSpec
from shared.rl.arch import PolicyArch, sampler_policy
from shared.rl.policy_onnx import OnnxPolicy
import services.sampler.rollout, services.sampler.service  # the sampler's own modules import no torch either
out = {{}}
for name, kw in json.loads({json.dumps(json.dumps({n: dataclasses.asdict(s) for n, (s, _) in cases.items()}))}).items():
    spec = FragmentSpec(**{{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()}})
    policy = sampler_policy(spec, PolicyArch("auto", 64), "onnx" if name == "mlp" else "auto")
    assert isinstance(policy, OnnxPolicy), type(policy)
    policy.load(pathlib.Path({str(tmp_path)!r}, name + ".st").read_bytes())
    obs = np.load(pathlib.Path({str(tmp_path)!r}, name + ".npy"))
    actions, logp = policy.act(obs, np.random.default_rng(1))
    assert actions.shape == (len(obs),) and logp.dtype == np.float32
    out[name] = policy.log_probs(obs).tolist()
assert sys.modules.get("torch") is None and not any(m.startswith("torch.") for m in sys.modules)
print(json.dumps(out))
"""
    done = _run(code)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name, (_, want) in cases.items():
        np.testing.assert_allclose(np.array(got[name], np.float32), want, atol=1e-5, rtol=1e-4, err_msg=name)


def test_the_sampler_entrypoint_imports_no_torch_for_auto_inference() -> None:
    done = _run("from services.sampler.__main__ import installation_problem\n"
                "from shared.settings import load_settings\n"
                "for inference in ('auto', 'numpy', 'onnx'):\n"
                "    s = load_settings('configs/minatar-breakout.yaml', {'FLYWHEEL_SAMPLER_INFERENCE': inference})\n"
                "    assert installation_problem(s) is None, inference\n"
                "print('ok')")
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_torch_inference_without_torch_stops_at_start_in_one_line_naming_the_extra() -> None:
    done = _run("from services.sampler.__main__ import main\nsys.argv = ['services.sampler']\nmain()",
                env={"FLYWHEEL_CONFIG": "configs/cartpole.yaml", "FLYWHEEL_SAMPLER_INFERENCE": "torch",
                     "FLYWHEEL_KAFKA_BOOTSTRAP": "127.0.0.1:1", "FLYWHEEL_HTTP_PORT": "0"})
    from services.sampler.__main__ import TORCH_MISSING

    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-2000:])
    assert done.stderr.strip().splitlines() == [f"flywheel sampler: {TORCH_MISSING}"], done.stderr
    assert "pip install 'flywheel[train]'" in TORCH_MISSING


@pytest.mark.parametrize("inference", ["auto", "torch"])
def test_torch_installed_is_no_problem(inference: str) -> None:
    from services.sampler.__main__ import installation_problem
    from shared.settings import load_settings

    settings = load_settings(REPO / "configs" / "cartpole.yaml", {"FLYWHEEL_SAMPLER_INFERENCE": inference})
    assert installation_problem(settings) is None
