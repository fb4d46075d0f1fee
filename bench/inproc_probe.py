import sys, time
import numpy as np
from shared.settings import load_settings
from shared.rl.envs import fragment_spec
from services.sampler.rollout import RolloutWorker
from services.trainer.learner import Learner
import torch
torch.set_num_threads(1)
s = load_settings("configs/cartpole.yaml", )
spec = fragment_spec(s.env.id, 1<<22)
L = Learner(spec, s.trainer)
workers = [RolloutWorker(s.env.id, s.env.num_envs, s.env.fragment_steps, f"s{i}", s.trainer.hidden, seed=i) for i in range(2)]
t0=time.time(); steps=0; v=0
for w in workers: w.set_policy(0, L.weights())
while time.time()-t0 < float(sys.argv[1]):
    frags=[]
    for k in range(s.trainer.batch_fragments):
        f = workers[k % 2].collect(); frags.append(f); L.record_returns(f)
    L.update(frags); v+=1
    for w in workers: w.set_policy(v, L.weights())
    steps += sum(f.steps for f in frags)
    r = L.counters.recent_returns
    if v % 20 == 0: print(f"{time.time()-t0:.1f}s steps={steps} upd={v} mean100={np.mean(r) if r else 0:.1f} n={len(r)}", flush=True)
    if len(r) >= 100 and np.mean(r) >= 475: print("SOLVED", time.time()-t0, steps); break
