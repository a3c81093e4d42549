"""Admin API on a real local CPU cluster (shared with test_admin_autoscaling / _dashboard, see
pools_harness.py): auth, scaling a pool at run time while requests flow, drain, pool metrics.

Disaggregated mode (prefill 1 → 2 while decode stays at 1, and the reverse) is in
test_disaggregated_admin.py, on the disaggregated cluster (disagg_harness.py). Nothing here asserts on
timings.
"""

import json
import pathlib
import re

import pytest

from pools_harness import (
    ADMIN,
    ADMIN_KEY,
    MODEL,
    USER,
    Load,
    http,
    pool,
    pools_cluster,  # noqa: F401
    running_ids,
    scale,
    settle,
    wait_for,
    worker_logs,
)

pytestmark = pytest.mark.slow

ROUTES = [
    ("GET", "/admin/pools", None),
    ("GET", "/admin/pools?history=true", None),
    ("GET", "/admin/pools/unified", None),
    ("POST", "/admin/pools/unified/scale", {"replicas": 2}),
    ("POST", "/admin/pools/unified/scale", {"autoscaling": True, "min_replicas": 1, "max_replicas": 2}),
    ("POST", "/admin/replicas/somereplica/drain", {"remove": True}),
    ("POST", "/admin/replicas/somereplica/undrain", None),
    ("POST", "/admin/pools/unified/scale", {"replicas": "not a number"}),
]


def test_every_admin_route_needs_the_admin_key(http):
    before = pool(http)
    for headers in (
        {},
        USER,
        {"Authorization": f"Bearer {ADMIN_KEY}x"},
        {"Authorization": ADMIN_KEY},
        {"X-Api-Key": ADMIN_KEY},
    ):
        for method, path, body in ROUTES:
            r = http.request(method, path, headers=headers, json=body)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
            assert r.json()["error"]["message"] and r.headers.get("www-authenticate") == "Bearer"
    after = pool(http)
    assert (after["mode"], after["target_replicas"]) == (before["mode"], before["target_replicas"])
    # the admin key is not a user key either, and the user key still works where it belongs
    assert http.get("/v1/models", headers=ADMIN).status_code == 401
    assert http.get("/v1/models", headers=USER).status_code == 200
    # the dashboard page itself is a static shell: no pool data without the key
    page = http.get("/dashboard/", follow_redirects=True)
    assert (
        page.status_code == 200 and "<canvas" not in page.text and after["replicas"][0]["replica_id"] not in page.text
    )
    assert "default-src 'self'" in page.headers["content-security-policy"]


OPEN_ROUTES = {"/health", "/metrics"}
"""Routes that answer without a key (probes, scrapers); the dashboard's static files hold no data."""


def test_every_route_needs_its_key(http):
    """Each route the ingress serves (its OpenAPI document, read with the user key) answers 401 without
    a key; user routes take the user key, admin routes and /router/stats the admin key, never the other."""
    assert http.get("/openapi.json").status_code == 401
    spec = http.get("/openapi.json", headers=USER).json()
    paths = {p.replace("{pool}", "unified").replace("{replica_id}", "nosuch"): ops for p, ops in spec["paths"].items()}
    paths["/router/stats"] = {"get": {}}
    assert "/v1/chat/completions" in paths and "/admin/pools" in paths and "/generate" in paths
    for path, ops in paths.items():
        for method in ops:
            if path in OPEN_ROUTES or path.startswith("/dashboard"):
                continue
            r = http.request(method.upper(), path, json={})
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            admin_only = path.startswith("/admin") or path.startswith("/router/")
            wrong = USER if admin_only else ADMIN
            r = http.request(method.upper(), path, json={}, headers=wrong)
            assert r.status_code == 401, (method, path, "wrong key", r.status_code, r.text)
    for path in ("/health", "/metrics"):
        assert http.get(path).status_code == 200
    assert http.get("/router/stats", headers=ADMIN).status_code == 200
    assert http.get("/v1/models", headers=USER).status_code == 200


def test_bad_admin_requests_get_clear_errors(http):
    r = http.post("/admin/pools/nosuchpool/scale", json={"replicas": 2}, headers=ADMIN)
    assert r.status_code == 404 and "nosuchpool" in r.json()["error"]["message"]
    for body in (
        {"replicas": 0},
        {"replicas": 1000},
        {},
        {"replicas": 2, "min_replicas": 1},
        {"min_replicas": 3, "max_replicas": 2},
        {"autoscaling": False, "max_replicas": 3},
        {"replica": 2},
    ):
        r = http.post("/admin/pools/unified/scale", json=body, headers=ADMIN)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = http.post("/admin/replicas/nosuchreplica/drain", json={}, headers=ADMIN)
    assert r.status_code == 404
    assert http.post("/admin/replicas/nosuchreplica/undrain", headers=ADMIN).status_code == 404
    r = http.get("/admin/pools/nosuchpool", headers=ADMIN)
    assert r.status_code == 404 and "nosuchpool" in r.json()["error"]["message"]
    only = running_ids(pool(http))
    if len(only) == 1:  # draining the last routable replica would leave nothing to route to
        r = http.post(f"/admin/replicas/{only[0]}/drain", json={}, headers=ADMIN)
        assert r.status_code == 409, r.text


def _state(http, replica_id: str) -> str:
    return next(r["state"] for r in pool(http)["replicas"] if r["replica_id"] == replica_id)


def test_scale_up_drain_and_remove_while_requests_flow(pools_cluster, http):
    """Acceptance 1 (unified pool): 1 → 2 replicas through the admin API while clients keep sending
    requests; none fails, the router starts using the new replica, and Router and Ingress keep their
    replicas. Then, still under load: drain a replica (no new requests reach it), undrain it (it gets
    requests again), and drain it with remove=true (the pool shrinks back to 1 around the other one)."""
    scale(http, replicas=1)
    (original,) = running_ids(settle(http, 1))
    stats_before = http.get("/router/stats", headers=ADMIN).json()
    with Load(pools_cluster, clients=3) as load:
        wait_for(lambda: load.count() >= 3, 120, "first requests")
        p = scale(http, replicas=2)
        assert (p["mode"], p["target_replicas"]) == ("manual", 2)
        (newcomer,) = set(running_ids(settle(http, 2))) - {original}
        mark = load.count()
        wait_for(lambda: load.count() >= mark + 6, 180, "requests after the new replica joined")
        served = worker_logs()
        assert any(served.get(rid) == newcomer for rid in load.rids(mark)), "router never used the new replica"
        assert any(served.get(rid) == original for rid in load.rids(mark))

        r = http.post(f"/admin/replicas/{newcomer}/drain", json={}, headers=ADMIN)
        assert r.status_code == 200, r.text
        assert r.json()["state"] in ("draining", "drained") and not r.json()["routable"]
        wait_for(lambda: _state(http, newcomer) == "drained", 60, "the drained state")
        assert newcomer not in http.get("/router/stats", headers=ADMIN).json()["workers"]
        mark = load.count()
        wait_for(lambda: load.count() >= mark + 4, 120, "requests while drained")
        served = worker_logs()
        assert {served.get(rid) for rid in load.rids(mark)} == {original}

        r = http.post(f"/admin/replicas/{newcomer}/undrain", headers=ADMIN)
        assert r.status_code == 200 and r.json()["state"] == "running", r.text
        wait_for(
            lambda: newcomer in http.get("/router/stats", headers=ADMIN).json()["workers"],
            30,
            "the replica to route again",
        )
        mark = load.count()
        wait_for(
            lambda: any(worker_logs().get(rid) == newcomer for rid in load.rids(mark)),
            120,
            "requests on the undrained replica",
        )

        r = http.post(f"/admin/replicas/{newcomer}/drain", json={"remove": True}, headers=ADMIN)
        assert r.status_code == 200, r.text
        one = settle(http, 1)
        mark = load.count()
        wait_for(lambda: load.count() >= mark + 3, 120, "requests after the removal")
    assert load.failures() == [], load.failures()[:5]
    assert running_ids(one) == [original] and one["target_replicas"] == 1
    # the other deployments were not redeployed: same ingress replica, the router's counters go on
    stats_after = http.get("/router/stats", headers=ADMIN).json()
    assert stats_after["ingress_replica"]["replica"] == stats_before["ingress_replica"]["replica"]
    assert stats_after["routed_requests"] > stats_before["routed_requests"]


def test_pool_metrics_carry_pool_and_replica_labels(http):
    for i in range(2):
        assert (
            http.post(
                "/generate",
                headers=USER,
                json={"text": f"Hello {i}", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            ).status_code
            == 200
        )
    p = pool(http)
    text = http.get("/metrics").text
    label = f'model_name="{MODEL}",pool="unified"'
    assert f"radixserve_pool_target_replicas{{{label}}} {float(p['target_replicas'])}" in text
    assert f'radixserve_pool_time_to_first_token_seconds_bucket{{le="+Inf",{label}}}' in text
    assert f"radixserve_pool_inter_token_latency_seconds_count{{{label}}}" in text
    rid = p["replicas"][0]["replica_id"]
    assert f'radixserve_replica_state{{{label},replica="{rid}",state="running"}} 1.0' in text
    assert p["ttft_p90_ms"] is not None and p["ttft_p90_ms"] > 0
    # every series the Grafana dashboard queries is exported
    grafana = json.loads((pathlib.Path(__file__).parents[2] / "deploy/grafana/radixserve.json").read_text())
    exprs = [t["expr"] for panel in grafana["panels"] for t in panel["targets"]]
    names = {n for e in exprs for n in re.findall(r"radixserve_\w+", e)}
    assert len(names) >= 12
    missing = [n for n in names if not re.search(rf"^{n}(\{{| )", text, re.M)]
    assert missing == [], missing
    assert p["itl_p90_ms"] is not None and p["itl_p90_ms"] > 0
