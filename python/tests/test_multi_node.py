"""`lossy bench` as one rank per process under a real torchrun: rank 0 prints the table
with a line per rank, the other rank prints nothing."""

import subprocess
import sys

from conftest import clean_env, free_port, lossy_binary


def test_torchrun_starts_two_bench_ranks_and_rank_0_prints_the_table(tmp_path):
    lossy = lossy_binary()
    log_dir = tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
         "--log_dir", str(log_dir), "--redirects", "3", "--no-python",
         lossy, "bench", "--sizes", "64K", "--iters", "2"],
        env=clean_env(NCCL_SOCKET_IFNAME="lo", OMP_NUM_THREADS=1),
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    outs = {}
    for path in log_dir.rglob("stdout.log"):
        rank = int(path.parent.name)
        outs[rank] = path.read_text()
    assert sorted(outs) == [0, 1], outs
    table = outs[0]
    assert "all_reduce, 2 ranks" in table, table
    for rank in (0, 1):
        assert any(line.startswith(f"# {rank:>4} ") and " lo " in line
                   for line in table.splitlines()), table
    assert outs[1] == "", outs[1]
