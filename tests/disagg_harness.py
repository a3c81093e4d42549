"""One CPU cluster in mode=disaggregated shared by test_disaggregated.py and test_disaggregated_admin.py
(the `disagg_cluster` fixture of tests/cluster/conftest.py): deployed by the first of them on Ray and Serve
that the modules before them started (cluster_harness.SHARED_SERVE), so the two modules pay the
application's start-up once and Ray's not at all.

The cluster: 1 prefill + 1 decode replica of the default model, KV handed over through NIXL over host
memory (UCX), pages of 4 tokens, round_robin routing (a new replica gets requests at once), the API key
and the distinct admin key of pools_harness.py (/router/stats needs the admin key), report_interval_s
0.25, a KV transfer timeout of 20 s and Serve health checks every second (a killed replica is replaced
soon). test_disaggregated.py runs first on the fresh cluster and leaves one replica per pool; the admin
tests settle each pool's size before they scale it.
"""

from pools_harness import ADMIN, ADMIN_KEY, API_KEY, USER  # noqa: F401 - ADMIN and USER are used by the test modules

APP = "radixserve-pd"
MODEL = "SmolLM2-135M-Instruct"
PAGE = 4


def args():
    """The shared cluster's ClusterArgs."""
    from cluster.config import ClusterArgs

    return ClusterArgs(
        mode="disaggregated",
        prefill_workers=1,
        decode_workers=1,
        kv_transfer="nixl",
        policy="round_robin",
        num_cpus=0.5,
        max_total_tokens=4096,
        page_size=PAGE,
        report_interval_s=0.25,
        kv_transfer_timeout_s=20,
        health_check_period_s=1.0,
        api_key=API_KEY,
        admin_api_key=ADMIN_KEY,
    )
