"""The megatron-core patch module's lock across a fork: needs neither megatron-core nor torch
(the module imports without them), so it runs wherever the package does."""

import json

from conftest import TESTS, clean_env, run_python


# A DataLoader worker is forked while another thread of the training process applies or
# reverts the patch: the child inherits the patch's lock held by a thread that does not exist
# in it, and its first call into the patch module waited for it forever.
FORK_WHILE_PATCHING = r"""
import json, sys
from nccl_lossy import megatron as patch
sys.path.insert(0, sys.argv[1])
from forking import hung_while

def patcher():
    patch.apply_megatron_core_patch()
    patch.revert_megatron_core_patch()

def worker():
    patch.is_patched()
    patch.applied_patches()

print(json.dumps({"hung": hung_while(patcher, worker, forks=20)}))
"""


def test_a_forked_worker_can_call_the_patch_module_while_a_thread_of_its_parent_patches():
    proc = run_python(FORK_WHILE_PATCHING, env=clean_env(), timeout=400, args=(str(TESTS),))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"hung": 0}
