"""LossyMegatronIntegration against the plugin's own counters: after every kind of toggle
(attribute, enable/disable, phase, step) a message goes through the real plugin, loaded the way
NCCL loads it, and the packets it lost must agree with ``injecting()``."""

import json

from conftest import TESTS, clean_env, run_python

# 1 MiB messages cut into 512-byte packets: 2,048 packets each. With independent loss at rate
# 0.5 the chance that an injecting message loses none is 0.5**2048 (nil), and the lost count
# is Binomial(2048, 0.5): mean 1024, standard deviation sqrt(2048 / 4) = 22.6, so the window
# [820, 1228] (+-9 sd) cannot fail by chance; a message sent while not injecting loses exactly 0.
# The profile seed is fixed (the default, 1), so the counts are the same on every run.
SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import nccl_lossy
from net_harness import Link

integ = nccl_lossy.LossyMegatronIntegration(
    set={"mtu": 512, "model.rate": 0.5, "effect": "zero"}, patch_megatron=False)
integ.enable()                     # puts NCCL_NET_PLUGIN & co. in place; NCCL has not started
link = Link(1 << 20)               # loads the plugin from NCCL_NET_PLUGIN, as NCCL does
rows = []

def check(label):
    before = nccl_lossy.stats()["total"]
    link.send()
    after = nccl_lossy.stats()["total"]
    rows.append({"toggle": label, "injecting": integ.injecting(), "phase": integ.phase,
                 "packets": after["packets"] - before["packets"],
                 "lost": after["lost_packets"] - before["lost_packets"]})

check("enable()")
integ.enable_on_backward = False
integ.mark_backward()
check("mark_backward() with enable_on_backward False")
integ.enable_on_backward = True    # the phase stays backward: only the attribute changes
check("attribute enable_on_backward = True")
integ.mark_backward()
check("mark_backward() again")
integ.enable_on_backward = False
check("attribute enable_on_backward = False")
integ.enable_on_forward = False
integ.mark_forward()
check("mark_forward() with enable_on_forward False")
integ.enable_on_forward = True
check("attribute enable_on_forward = True")
integ.phase = "backward"
check("attribute phase = backward")
integ.mark_any()
check("mark_any()")
integ.disable()
check("disable()")
integ.enable()
check("enable() again")
integ.enabled = False
check("attribute enabled = False")
integ.enabled = True
check("attribute enabled = True")
integ.step(7)
check("step(7)")
integ.step_number = 9
check("attribute step_number = 9")
integ.step()
check("step()")
by_step = {s["step"]: s["packets"] for s in nccl_lossy.stats()["by_step"]}
link.close()
print(json.dumps({"rows": rows, "by_step": by_step, "step": integ.step_number}))
"""

EXPECTED = [
    ("enable()", True),
    ("mark_backward() with enable_on_backward False", False),
    ("attribute enable_on_backward = True", True),
    ("mark_backward() again", True),
    ("attribute enable_on_backward = False", False),
    ("mark_forward() with enable_on_forward False", False),
    ("attribute enable_on_forward = True", True),
    ("attribute phase = backward", False),
    ("mark_any()", True),
    ("disable()", False),
    ("enable() again", True),
    ("attribute enabled = False", False),
    ("attribute enabled = True", True),
    ("step(7)", True),
    ("attribute step_number = 9", True),
    ("step()", True),
]


def test_plugin_counters_agree_with_injecting_after_every_toggle():
    proc = run_python(SCRIPT, env=clean_env(NCCL_SOCKET_IFNAME="lo"), args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = out["rows"]
    assert [(r["toggle"], r["injecting"]) for r in rows] == EXPECTED
    for r in rows:
        assert r["packets"] == 2048, r
        if r["injecting"]:
            assert 820 <= r["lost"] <= 1228, r  # the plugin injects, at the profile's rate
        else:
            assert r["lost"] == 0, r  # the plugin is off, as injecting() says
    # the steps reached the plugin: each step's message is counted under that step
    assert out["step"] == 10
    assert {int(k): v for k, v in out["by_step"].items()} == {7: 2048, 9: 2048, 10: 2048}
