"""The fake API server speaks the protocol the official client expects (typed models, Watch, errors)."""

from __future__ import annotations

import json
import threading
from typing import Any

import kubernetes.client as k8s
import pytest
from fake_apiserver import FakeApiServer, label_matcher
from kubernetes import watch
from kubernetes.client.exceptions import ApiException


def job(name: str, labels: dict[str, str] | None = None, containers: int = 1) -> Any:
    """A Job manifest as a plain dict (the client turns it into its V1Job model)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": labels or {}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": f"c{i}", "image": "busybox"} for i in range(containers)],
                },
            },
        },
    }


def apis(server: FakeApiServer) -> tuple[Any, Any]:
    """The official BatchV1Api and CoreV1Api on the fake (typed loosely: tests read Optional fields freely)."""
    client = server.api_client()
    return k8s.BatchV1Api(client), k8s.CoreV1Api(client)


def test_create_conflict_and_invalid_objects_answer_like_kubernetes(apiserver: FakeApiServer) -> None:
    batch, _ = apis(apiserver)
    created = batch.create_namespaced_job("ns", job("a"))
    assert created.metadata.name == "a" and created.metadata.uid and created.status.active == 1
    with pytest.raises(ApiException) as conflict:
        batch.create_namespaced_job("ns", job("a"))
    status = json.loads(str(conflict.value.body))
    assert conflict.value.status == 409
    assert (status["kind"], status["reason"], status["code"]) == ("Status", "AlreadyExists", 409)
    assert status["message"] == 'jobs.batch "a" already exists'
    with pytest.raises(ApiException) as invalid:
        batch.create_namespaced_job("ns", job("Not_A_Name", labels={"bad label": "x"}))
    assert invalid.value.status == 422
    assert "DNS-1123" in json.loads(str(invalid.value.body))["message"]


def test_list_filters_by_label_and_carries_a_monotonic_resource_version(apiserver: FakeApiServer) -> None:
    batch, core = apis(apiserver)
    batch.create_namespaced_job("ns", job("a", {"team": "x"}))
    first = batch.list_namespaced_job("ns", label_selector="team=x")
    batch.create_namespaced_job("ns", job("b", {"team": "y"}))
    batch.create_namespaced_job("other", job("c", {"team": "x"}))
    second = batch.list_namespaced_job("ns", label_selector="team=x")
    assert [j.metadata.name for j in second.items] == ["a"]
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    pods = core.list_namespaced_pod("ns", label_selector="team in (x,y)").items
    assert sorted(p.metadata.labels["job-name"] for p in pods) == ["a", "b"]
    versions = [int(o["metadata"]["resourceVersion"]) for o in apiserver.jobs() + apiserver.pods()]
    assert len(set(versions)) == len(versions)  # one counter for every object of the server


def test_label_selectors() -> None:
    labels = {"a": "1", "b": "2"}
    assert label_matcher("a=1,b==2")(labels)
    assert not label_matcher("a!=1")(labels)
    assert label_matcher("a,!c,b notin (3,4)")(labels)
    assert not label_matcher("c")(labels)
    assert label_matcher("")(labels)


def test_the_official_watch_replays_from_a_version_and_raises_410_when_it_is_gone(apiserver: FakeApiServer) -> None:
    batch, _ = apis(apiserver)
    start = batch.list_namespaced_job("ns").metadata.resource_version
    batch.create_namespaced_job("ns", job("a"))
    apiserver.set_pod_running("a")
    apiserver.set_pod_succeeded("a")
    events = [
        (e["type"], e["object"].metadata.name, bool(e["object"].status.succeeded))
        for e in watch.Watch().stream(batch.list_namespaced_job, "ns", resource_version=start, timeout_seconds=1)
    ]
    assert events[0] == ("ADDED", "a", False)
    assert events[-1] == ("MODIFIED", "a", True)
    apiserver.compact()
    with pytest.raises(ApiException) as gone:
        for _ in watch.Watch().stream(batch.list_namespaced_job, "ns", resource_version=start, timeout_seconds=1):
            pass
    assert gone.value.status == 410


def test_a_live_watch_sees_changes_and_a_dropped_one_ends(apiserver: FakeApiServer) -> None:
    batch, _ = apis(apiserver)
    version = batch.list_namespaced_job("ns").metadata.resource_version
    seen: list[str] = []

    def consume() -> None:
        try:
            for event in watch.Watch().stream(
                batch.list_namespaced_job, "ns", resource_version=version, timeout_seconds=30
            ):
                seen.append(event["type"])
        except Exception as e:  # the dropped connection surfaces as a protocol error
            seen.append(type(e).__name__)

    thread = threading.Thread(target=consume)
    thread.start()
    batch.create_namespaced_job("ns", job("a"))
    for _ in range(100):
        if seen:
            break
        threading.Event().wait(0.02)
    apiserver.drop_watches()
    thread.join(5)
    assert not thread.is_alive()
    assert seen[0] == "ADDED" and len(seen) >= 2 and seen[-1] not in ("ADDED", "MODIFIED")


def test_delete_propagation_and_logs(apiserver: FakeApiServer) -> None:
    batch, core = apis(apiserver)
    batch.create_namespaced_job("ns", job("orphaned"))
    batch.create_namespaced_job("ns", job("gone", containers=2))
    apiserver.set_logs("gone", "one\ntwo\nthree\n", container="c1")
    pod = apiserver.pod_of("gone")["metadata"]["name"]
    assert core.read_namespaced_pod_log(pod, "ns", container="c1", tail_lines=2) == "two\nthree\n"
    with pytest.raises(ApiException) as ambiguous:
        core.read_namespaced_pod_log(pod, "ns")
    assert (
        ambiguous.value.status == 400 and "choose one of: [c0 c1]" in json.loads(str(ambiguous.value.body))["message"]
    )
    batch.delete_namespaced_job("orphaned", "ns")  # Jobs orphan their pods by default
    batch.delete_namespaced_job("gone", "ns", propagation_policy="Background")
    assert [p["metadata"]["labels"]["job-name"] for p in apiserver.pods()] == ["orphaned"]
    assert apiserver.jobs() == []
    with pytest.raises(ApiException) as missing:
        batch.delete_namespaced_job("gone", "ns")
    assert missing.value.status == 404


def test_the_job_controller_and_kubelet_simulation(apiserver: FakeApiServer) -> None:
    batch, _ = apis(apiserver)
    batch.create_namespaced_job("ns", job("ok"))
    apiserver.set_pod_running("ok")
    apiserver.set_pod_succeeded("ok")
    done = apiserver.job("ok")["status"]
    assert done["succeeded"] == 1 and [c["type"] for c in done["conditions"]] == ["SuccessCriteriaMet", "Complete"]
    batch.create_namespaced_job("ns", job("late"))
    apiserver.exceed_deadline("late")
    failed = apiserver.job("late")["status"]["conditions"][-1]
    assert (failed["type"], failed["reason"]) == ("Failed", "DeadlineExceeded")
    assert not [p for p in apiserver.pods() if p["metadata"]["labels"]["job-name"] == "late"]
    retried = job("retried")
    retried["spec"]["backoffLimit"] = 1
    batch.create_namespaced_job("ns", retried)
    apiserver.set_pod_failed("retried", 2)
    assert len([p for p in apiserver.pods() if p["metadata"]["labels"]["job-name"] == "retried"]) == 2
    assert "conditions" not in apiserver.job("retried")["status"]


def secret(name: str, owner: Any = None, **data: str) -> Any:
    """A Secret manifest (data given as plain text, sent as stringData)."""
    meta: dict[str, Any] = {"name": name}
    if owner is not None:
        meta["ownerReferences"] = [
            {"apiVersion": "batch/v1", "kind": "Job", "name": owner.metadata.name, "uid": owner.metadata.uid}
        ]
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "stringData": data}


@pytest.mark.parametrize("policy", ["Background", "Foreground", "Orphan"])
def test_secrets_are_served_and_follow_their_owner_job(policy: str) -> None:
    with FakeApiServer() as server:
        batch, core = apis(server)
        owner = batch.create_namespaced_job("ns", job("j1"))
        created = core.create_namespaced_secret("ns", secret("s1", owner, token="t-1"))
        assert created.data == {"token": "dC0x"} and created.type == "Opaque"  # stringData stored as base64
        assert core.read_namespaced_secret("s1", "ns").metadata.owner_references[0].uid == owner.metadata.uid
        assert [s.metadata.name for s in core.list_namespaced_secret("ns").items] == ["s1"]
        with pytest.raises(ApiException) as conflict:
            core.create_namespaced_secret("ns", secret("s1", owner, token="t-2"))
        assert conflict.value.status == 409 and json.loads(conflict.value.body or "{}")["reason"] == "AlreadyExists"
        with pytest.raises(ApiException) as invalid:
            core.create_namespaced_secret("ns", secret("s2", owner, **{"bad key": "x"}))
        assert invalid.value.status == 422
        batch.delete_namespaced_job("j1", "ns", propagation_policy=policy)
        left = core.list_namespaced_secret("ns").items
        if policy == "Orphan":
            assert [s.metadata.name for s in left] == ["s1"] and not left[0].metadata.owner_references
        else:
            assert left == []


def test_a_secret_whose_owner_is_gone_is_collected() -> None:
    with FakeApiServer() as server:
        batch, core = apis(server)
        owner = batch.create_namespaced_job("ns", job("j1"))
        batch.delete_namespaced_job("j1", "ns", propagation_policy="Background")
        core.create_namespaced_secret("ns", secret("s1", owner, token="t"))
        assert core.list_namespaced_secret("ns").items == []
        core.create_namespaced_secret("ns", secret("s2", token="t"))  # no owner: kept
        core.delete_namespaced_secret("s2", "ns")
        with pytest.raises(ApiException) as gone:
            core.read_namespaced_secret("s2", "ns")
        assert gone.value.status == 404
