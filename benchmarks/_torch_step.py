"""One fresh process's first torch.compile'd training step of a small model on the CPU
(Inductor's C++ backend): prints one line ``STEP-JSON:{...}`` with the step's wall time,
torch's own cache counters, the C++ builds that ran, and the sha256 of the outputs and the
updated weights (bitwise equality across runs). argv: ``kdb`` to call kdb.torch.install()
from code (else kdb is on only through KDB_AUTO, or off); ``other-torch`` to run as
another torch release (its version changed: Inductor's keys and kdb's differ); ``tiny`` for a model of one linear layer (fewer kernels: tests
that run several processes at once). Used by benchmarks/torch_compile.py and
tests/test_torch.py."""

import hashlib
import json
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

if "other-torch" in sys.argv:  # as another torch release: Inductor's keys and kdb's differ
    torch.__version__ = type(torch.__version__)(torch.__version__ + ".other")
if "kdb" in sys.argv:
    import kdb.torch

    kdb.torch.install()

builds = []
try:  # the C++ compiles that ran, whoever (kdb or not) asked for them
    # Counted where the compiler is run, not at CppBuilder.build: on torch 2.7 importing
    # cpp_builder imports Inductor's code cache, so KDB_AUTO's kdb wraps build first and a
    # wrapper put here would count the builds kdb serves too.
    from torch._inductor import cpp_builder

    _run = cpp_builder.run_compile_cmd

    def counted(cmd_line, *args, **kwargs):
        words = str(cmd_line).split()
        out = words[words.index("-o") + 1] if "-o" in words[:-1] else "?"
        builds.append(out.rsplit("/", 1)[-1])
        return _run(cmd_line, *args, **kwargs)

    cpp_builder.run_compile_cmd = counted
except (ImportError, AttributeError):
    pass


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.ln = torch.nn.Linear(64, 128), torch.nn.LayerNorm(128)
        self.l2, self.l3 = torch.nn.Linear(128, 128), torch.nn.Linear(128, 10)

    def forward(self, x):
        h = torch.relu(self.ln(self.l1(x)))
        return torch.softmax(self.l3(torch.relu(self.l2(h))), dim=-1)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(64, 10)

    def forward(self, x):
        return torch.softmax(torch.relu(self.l1(x)), dim=-1)


torch.manual_seed(0)
model = Tiny() if "tiny" in sys.argv else Model()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
compiled = torch.compile(model)
t1 = time.perf_counter()
out = compiled(x)
torch.nn.functional.nll_loss(torch.log(out), y).backward()
opt.step()
t2 = time.perf_counter()
digest = hashlib.sha256(out.detach().numpy().tobytes())
for p in model.parameters():
    digest.update(p.detach().numpy().tobytes())
inductor, aot = counters["inductor"], counters["aot_autograd"]
print("STEP-JSON:" + json.dumps({
    "first_step": t2 - t1, "import": t1 - t0, "torch": torch.__version__,
    "fx_hit": inductor["fxgraph_cache_hit"], "fx_miss": inductor["fxgraph_cache_miss"],
    "aot_hit": aot["autograd_cache_hit"], "aot_miss": aot["autograd_cache_miss"],
    "cpp_builds": len(builds), "digest": digest.hexdigest()}), flush=True)
