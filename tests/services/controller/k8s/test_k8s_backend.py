"""The Kubernetes backend against the fake API server: launch, watch, failure reasons, recovery, cleanup."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Callable
from typing import Any

import pytest
from fake_apiserver import FakeApiServer
from k8s_support import NAMESPACE, TEMPLATE, StateLog, launch_spec

from services.controller.backends.base import (
    ExecutionBackend,
    ExecutionKey,
    ExecutionState,
    PermanentBackendError,
    RolloutKey,
    TemporaryBackendError,
)
from services.controller.backends.k8s_template import TemplateError, job_name, validate_manifest
from services.controller.backends.kubernetes import KubernetesBackend, KubernetesSettings
from services.controller.backends.ratelimit import TokenBucket

Make = Callable[..., KubernetesBackend]
KEY = ExecutionKey("run-1", "rollout-1", "attempt-1")
NAME = job_name(KEY)


def of(key: ExecutionKey, phase: str | None = None, **fields: Any) -> Callable[[ExecutionState], bool]:
    """A predicate for `StateLog.until`: this execution, in this phase, with these field values."""

    def match(state: ExecutionState) -> bool:
        return (
            state.key == key
            and (phase is None or state.phase == phase)
            and all(getattr(state, k) == v for k, v in fields.items())
        )

    return match


def secret_of(apiserver: FakeApiServer, name: str) -> dict[str, str]:
    """The decoded data of the Secret called `name`."""
    (secret,) = [s for s in apiserver.secrets(NAMESPACE) if s["metadata"]["name"] == name]
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


async def test_the_tokens_live_in_a_secret_owned_by_the_job(
    backend: KubernetesBackend, apiserver: FakeApiServer
) -> None:
    spec = launch_spec(KEY, evaluator_command=["grade"], evaluator_env={"ROLLWIRE_TOKEN": "eval-token"})
    await backend.launch(spec)
    job = apiserver.job(NAME)
    assert "agent-token" not in json.dumps(job) and "eval-token" not in json.dumps(job)
    assert "agent-token" not in json.dumps(apiserver.pods(NAMESPACE))
    assert secret_of(apiserver, NAME) == {
        "agent.OPENAI_API_KEY": "agent-token",
        "evaluator.ROLLWIRE_TOKEN": "eval-token",
    }
    (secret,) = apiserver.secrets(NAMESPACE)
    assert secret["metadata"]["ownerReferences"] == [
        {"apiVersion": "batch/v1", "kind": "Job", "name": NAME, "uid": job["metadata"]["uid"]}
    ]
    pod = job["spec"]["template"]["spec"]
    refs = {
        (c["name"], e["name"]): e["valueFrom"]["secretKeyRef"]
        for c in [*pod["initContainers"], *pod["containers"]]
        for e in c["env"]
        if "valueFrom" in e
    }
    assert refs == {
        ("agent", "OPENAI_API_KEY"): {"name": NAME, "key": "agent.OPENAI_API_KEY"},
        ("evaluator", "ROLLWIRE_TOKEN"): {"name": NAME, "key": "evaluator.ROLLWIRE_TOKEN"},
    }
    await backend.cancel(KEY)
    assert apiserver.jobs(NAMESPACE) == [] and apiserver.secrets(NAMESPACE) == []


async def test_a_repeated_launch_keeps_one_secret_and_cleanup_removes_it(
    make_backend: Make, apiserver: FakeApiServer
) -> None:
    await make_backend().launch(launch_spec(KEY))
    await make_backend().launch(launch_spec(KEY))  # a restarted controller: 409 on the Job and the Secret
    assert len(apiserver.jobs(NAMESPACE)) == 1 and len(apiserver.secrets(NAMESPACE)) == 1
    assert apiserver.count("POST", "secrets") == 2 and apiserver.count("DELETE", "secrets") == 0
    fresh = launch_spec(KEY, env={"OPENAI_API_KEY": "new-token"})
    await make_backend().launch(fresh)  # other data: the launch's credentials win
    assert secret_of(apiserver, NAME) == {"agent.OPENAI_API_KEY": "new-token"}
    assert await make_backend().cleanup(set()) == 1
    assert apiserver.secrets(NAMESPACE) == []


async def test_a_launch_cut_before_the_secret_creates_it_when_repeated(
    backend: KubernetesBackend, apiserver: FakeApiServer
) -> None:
    apiserver.fail_next("POST", "secrets", 503)
    with pytest.raises(TemporaryBackendError):
        await backend.launch(launch_spec(KEY))
    assert len(apiserver.jobs(NAMESPACE)) == 1 and apiserver.secrets(NAMESPACE) == []
    await backend.launch(launch_spec(KEY))
    assert secret_of(apiserver, NAME) == {"agent.OPENAI_API_KEY": "agent-token"}
    assert len(apiserver.jobs(NAMESPACE)) == 1


async def test_the_backend_implements_the_contract(backend: KubernetesBackend) -> None:
    assert isinstance(backend, ExecutionBackend)
    assert backend.name == "kubernetes"


async def test_launch_creates_the_job_rendered_from_the_template(
    backend: KubernetesBackend, apiserver: FakeApiServer
) -> None:
    await backend.launch(launch_spec(KEY, timeout_s=120))
    (job,) = apiserver.jobs(NAMESPACE)
    assert job["metadata"]["name"] == NAME
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] == 120
    assert job["metadata"]["labels"]["rollwire.dev/attempt"] == "attempt-1"
    validate_manifest(job, "1.33")  # as stored by the server, strictly
    (pod,) = apiserver.pods(NAMESPACE)
    assert pod["metadata"]["annotations"]["rollwire.dev/input"] == '{"question": "2+2"}'


async def test_launching_twice_is_harmless(make_backend: Make, apiserver: FakeApiServer) -> None:
    first, second = make_backend(), make_backend()
    await first.launch(launch_spec(KEY))
    await second.launch(launch_spec(KEY))  # no cache yet: the POST gets 409 AlreadyExists
    assert apiserver.count("POST", "jobs") == 2
    assert len(apiserver.jobs()) == 1
    log = StateLog(first)
    await log.until(of(KEY, "pending"))
    await first.launch(launch_spec(KEY))  # known from the watch: no request at all
    assert apiserver.count("POST", "jobs") == 2
    await log.stop()


async def test_the_watch_follows_an_execution_to_success(
    backend: KubernetesBackend, apiserver: FakeApiServer, states: StateLog
) -> None:
    await backend.launch(launch_spec(KEY))
    await states.until(of(KEY, "pending"))
    apiserver.set_pod_running(NAME)
    running = await states.until(of(KEY, "running"))
    assert running.started_at is not None and running.execution == NAME
    apiserver.set_pod_succeeded(NAME)
    done = await states.until(of(KEY, "succeeded"))
    assert done.exit_code == 0 and done.finished_at is not None and done.reason is None
    assert states.phases(KEY) == ["pending", "running", "succeeded"]
    assert done.log_location == f"kubectl logs -n {NAMESPACE} job/{NAME} -c agent"


async def test_an_exit_code_comes_with_the_log_tail(
    backend: KubernetesBackend, apiserver: FakeApiServer, states: StateLog
) -> None:
    await backend.launch(launch_spec(KEY))
    await states.until(of(KEY, "pending"))
    apiserver.set_pod_running(NAME)
    apiserver.set_logs(NAME, "".join(f"step {i}\n" for i in range(100)) + "ValueError: no answer found\n")
    apiserver.set_pod_failed(NAME, 3)
    failed = await states.until(of(KEY, "failed"))
    assert failed.reason == "exit code 3 in container 'agent': ValueError: no answer found"
    assert failed.exit_code == 3
    assert failed.log_tail is not None and failed.log_tail.endswith("step 99\nValueError: no answer found\n")
    assert len(failed.log_tail.splitlines()) == 50  # log_tail_lines
    assert failed.log_location is not None and failed.log_location.startswith(f"kubectl logs -n {NAMESPACE} {NAME}-")
    # Only one failed state: the Job's generic "BackoffLimitExceeded" never reached the watcher.
    assert [s.reason for s in states.states if s.phase == "failed"] == [failed.reason]


async def test_a_failed_job_waits_for_its_pods_news(make_backend: Make, apiserver: FakeApiServer) -> None:
    backend = make_backend(pod_lag_s=0.8)
    log = StateLog(backend)
    await backend.launch(launch_spec(KEY))
    await log.until(of(KEY, "pending"))
    apiserver.hold_watch_events("pods")  # the pod watch lags behind the Job watch
    apiserver.set_logs(NAME, "IndexError: list index out of range\n")
    apiserver.set_pod_failed(NAME, 1)
    await asyncio.sleep(0.4)
    assert log.phases(KEY) == ["pending"]  # the Job says failed; the reason is still on its way
    apiserver.hold_watch_events("pods", held=False)
    failed = await log.until(of(KEY, "failed"))
    assert failed.reason == "exit code 1 in container 'agent': IndexError: list index out of range"
    assert [s.reason for s in log.states if s.phase == "failed"] == [failed.reason]
    await log.stop()


async def test_a_failed_job_whose_pods_never_report_keeps_the_jobs_reason(
    make_backend: Make, apiserver: FakeApiServer
) -> None:
    backend = make_backend(pod_lag_s=0.5)
    log = StateLog(backend)
    await backend.launch(launch_spec(KEY))
    await log.until(of(KEY, "pending"))
    apiserver.hold_watch_events("pods")
    apiserver.set_pod_failed(NAME, 1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    failed = await log.until(of(KEY, "failed"))
    assert loop.time() - started >= 0.4
    assert failed.reason == "BackoffLimitExceeded: Job has reached the specified backoff limit"
    await log.stop()


@pytest.mark.parametrize(
    ("break_it", "reason", "exit_code"),
    [
        (lambda s: s.set_pod_oom_killed(NAME), "OOMKilled: container 'agent' ran out of memory", 137),
        (lambda s: s.evict_pod(NAME, "The node was low on resource: memory."), "Evicted from its node: The node", None),
        (lambda s: s.exceed_deadline(NAME), "DeadlineExceeded: the attempt ran longer than its 600s timeout", None),
        (
            lambda s: s.set_pod_failed(NAME, 2, message="grader crashed"),
            "exit code 2 in container 'agent': grader crashed",
            2,
        ),
    ],
    ids=["oom", "evicted", "deadline", "termination-message"],
)
async def test_failure_reasons_a_person_can_act_on(
    backend: KubernetesBackend,
    apiserver: FakeApiServer,
    states: StateLog,
    break_it: Callable[[FakeApiServer], None],
    reason: str,
    exit_code: int | None,
) -> None:
    await backend.launch(launch_spec(KEY))
    await states.until(of(KEY, "pending"))
    apiserver.set_pod_running(NAME)
    break_it(apiserver)
    failed = await states.until(of(KEY, "failed"))
    assert failed.reason is not None and failed.reason.startswith(reason), failed.reason
    assert failed.exit_code == exit_code


async def test_an_image_that_cannot_be_pulled_fails_after_the_grace_period(
    make_backend: Make, apiserver: FakeApiServer
) -> None:
    backend = make_backend(stuck_grace_s=1.5)
    log = StateLog(backend)
    await backend.launch(launch_spec(KEY, image="registry.example/agnet:1"))
    await log.until(of(KEY, "pending"))
    apiserver.set_pod_waiting(NAME, "ImagePullBackOff", 'Back-off pulling image "registry.example/agnet:1"')
    stuck = await log.until(lambda s: s.key == KEY and s.reason is not None)
    assert stuck.phase == "pending"
    assert stuck.reason is not None and stuck.reason.startswith(
        "ImagePullBackOff: cannot pull image 'registry.example/agnet:1' for container 'agent'"
    )
    failed = await log.until(of(KEY, "failed"), timeout=5)  # no event: the backend's own timer
    assert failed.reason is not None and "agnet:1" in failed.reason and "stuck for" in failed.reason
    await log.stop()


async def test_an_evaluator_failure_names_the_evaluator(
    backend: KubernetesBackend, apiserver: FakeApiServer, states: StateLog
) -> None:
    spec = launch_spec(KEY, evaluator_command=["grade"], evaluator_env={"ROLLWIRE_TOKEN": "eval"})
    await backend.launch(spec)
    await states.until(of(KEY, "pending"))
    apiserver.set_pod_running(NAME, container="agent")  # the agent runs as an init container
    await states.until(of(KEY, "running"))
    apiserver.set_logs(NAME, "reward: cannot parse answer\n", container="evaluator")
    apiserver.set_pod_failed(NAME, 1, container="evaluator")
    failed = await states.until(of(KEY, "failed"))
    assert failed.reason == "exit code 1 in container 'evaluator': reward: cannot parse answer"


async def test_pending_and_unknown_reasons(
    backend: KubernetesBackend, apiserver: FakeApiServer, states: StateLog
) -> None:
    await backend.launch(launch_spec(KEY))
    await states.until(of(KEY, "pending"))
    apiserver.set_unschedulable(NAME, "0/3 nodes are available: 3 Insufficient memory.")
    await states.until(of(KEY, "pending", reason="Unschedulable: 0/3 nodes are available: 3 Insufficient memory."))
    apiserver.set_pod_running(NAME)
    apiserver.set_pod_phase_unknown(NAME)
    unknown = await states.until(of(KEY, "unknown"))
    assert unknown.reason is not None and "stopped reporting" in unknown.reason


async def test_lost_watch_events_are_recovered_by_the_periodic_list(
    make_backend: Make, apiserver: FakeApiServer
) -> None:
    backend = make_backend(resync_s=0.5)
    log = StateLog(backend)
    await backend.launch(launch_spec(KEY))
    await log.until(of(KEY, "pending"))
    jobs = backend.stats["jobs"]
    lists = jobs.lists
    apiserver.lose_watch_events()  # every watch, open or new, loses every event: only a list can tell
    apiserver.set_pod_running(NAME)
    apiserver.set_pod_succeeded(NAME)
    await log.until(of(KEY, "succeeded"), timeout=6)
    assert jobs.lists > lists and jobs.gone == 0
    await log.stop()


async def test_a_dropped_watch_resumes_from_its_last_version(
    backend: KubernetesBackend, apiserver: FakeApiServer, states: StateLog
) -> None:
    await backend.launch(launch_spec(KEY))
    await states.until(of(KEY, "pending"))
    apiserver.drop_watches()
    apiserver.set_pod_running(NAME)
    apiserver.set_pod_succeeded(NAME)
    await states.until(of(KEY, "succeeded"))
    jobs = backend.stats["jobs"]
    assert jobs.lists == 1 and jobs.watches >= 2  # resumed, no re-list needed


async def test_a_410_on_the_watch_is_recovered_by_listing_again(
    backend: KubernetesBackend, apiserver: FakeApiServer, states: StateLog
) -> None:
    await backend.launch(launch_spec(KEY))
    await states.until(of(KEY, "pending"))
    apiserver.lose_watch_events()
    apiserver.set_pod_running(NAME)
    apiserver.set_pod_succeeded(NAME)
    apiserver.compact()  # the versions the backend last saw are no longer in the history
    apiserver.drop_watches()
    await states.until(of(KEY, "succeeded"))
    jobs = backend.stats["jobs"]
    assert jobs.gone >= 1 and jobs.lists >= 2


async def test_cancel_deletes_the_job_and_its_pods(
    backend: KubernetesBackend, apiserver: FakeApiServer, states: StateLog
) -> None:
    await backend.launch(launch_spec(KEY))
    await states.until(of(KEY, "pending"))
    apiserver.set_pod_running(NAME)
    await states.until(of(KEY, "running"))
    await backend.cancel(KEY)
    assert apiserver.jobs() == [] and apiserver.pods() == []
    (delete,) = [r for r in apiserver.requests if r.method == "DELETE"]
    assert delete.query["propagationPolicy"] == "Background"
    gone = await states.until(of(KEY, deleted=True))
    assert gone.phase == "failed" and gone.reason == f"the Job {NAME} was deleted before it finished"
    await backend.cancel(KEY)  # already gone: harmless
    await backend.cancel(ExecutionKey("run-1", "never", "launched"))


async def test_a_finished_execution_that_is_deleted_keeps_its_phase(
    backend: KubernetesBackend, apiserver: FakeApiServer, states: StateLog
) -> None:
    await backend.launch(launch_spec(KEY))
    await states.until(of(KEY, "pending"))
    apiserver.set_pod_succeeded(NAME)
    await states.until(of(KEY, "succeeded"))
    apiserver.delete("jobs", NAMESPACE, NAME, "Background")  # the TTL controller, or a person
    gone = await states.until(of(KEY, deleted=True))
    assert gone.phase == "succeeded"
    assert await backend.list() == []


async def test_cleanup_deletes_jobs_whose_rollout_is_gone(backend: KubernetesBackend, apiserver: FakeApiServer) -> None:
    keys = [
        ExecutionKey("run-1", "kept", "a1"),
        ExecutionKey("run-1", "kept", "a2"),
        ExecutionKey("run-1", "dropped", "a1"),
        ExecutionKey("run-2", "kept", "a1"),  # same rollout id, other run: not kept
    ]
    for key in keys:
        await backend.launch(launch_spec(key))
    assert await backend.cleanup({RolloutKey("run-1", "kept")}) == 2
    assert sorted(j["metadata"]["name"] for j in apiserver.jobs()) == sorted(job_name(k) for k in keys[:2])
    assert len(apiserver.pods()) == 2
    assert await backend.cleanup([RolloutKey("run-1", "kept")]) == 0
    assert await backend.cleanup([]) == 2


async def test_list_reports_every_execution_with_reasons(backend: KubernetesBackend, apiserver: FakeApiServer) -> None:
    ok, bad, waiting = (ExecutionKey("run-1", f"r{i}", "a1") for i in range(3))
    for key in (ok, bad, waiting):
        await backend.launch(launch_spec(key))
    apiserver.set_pod_succeeded(job_name(ok))
    apiserver.set_logs(job_name(bad), "Traceback ...\nKeyError: 'answer'\n")
    apiserver.set_pod_failed(job_name(bad), 1)
    listed = {s.key: s for s in await backend.list()}
    assert {k: s.phase for k, s in listed.items()} == {ok: "succeeded", bad: "failed", waiting: "pending"}
    assert listed[bad].reason == "exit code 1 in container 'agent': KeyError: 'answer'"
    assert listed[bad].log_tail == "Traceback ...\nKeyError: 'answer'\n"


async def test_only_this_instances_jobs_are_seen(make_backend: Make, apiserver: FakeApiServer) -> None:
    mine, theirs = make_backend(instance="blue"), make_backend(instance="green")
    await mine.launch(launch_spec(KEY))
    await theirs.launch(launch_spec(ExecutionKey("run-9", "r", "a")))
    assert [s.key for s in await mine.list()] == [KEY]
    assert await mine.cleanup([]) == 1
    assert len(apiserver.jobs()) == 1


async def test_close_ends_every_watch(make_backend: Make) -> None:
    backend = make_backend()
    log = StateLog(backend)
    await backend.launch(launch_spec(KEY))
    await log.until(of(KEY, "pending"))
    await backend.close()
    await asyncio.wait_for(log._task, 2)
    with pytest.raises(PermanentBackendError, match="closed"):
        await backend.launch(launch_spec(KEY))


# --- errors ---


async def test_api_errors_are_sorted_into_temporary_and_permanent(
    backend: KubernetesBackend, apiserver: FakeApiServer
) -> None:
    apiserver.fail_next("POST", "jobs", 500)
    with pytest.raises(TemporaryBackendError, match="the API server failed"):
        await backend.launch(launch_spec(KEY))
    apiserver.fail_next("POST", "jobs", 429, reason="TooManyRequests", retry_after=7)
    with pytest.raises(TemporaryBackendError) as throttled:
        await backend.launch(launch_spec(KEY))
    assert throttled.value.retry_after == 7
    apiserver.fail_next("POST", "jobs", 403, reason="Forbidden", message="exceeded quota: compute, requested: cpu=1")
    with pytest.raises(TemporaryBackendError) as quota:
        await backend.launch(launch_spec(KEY))
    assert quota.value.retry_after == 10
    apiserver.fail_next("POST", "jobs", 403, reason="Forbidden", message='jobs.batch is forbidden: User "x"')
    with pytest.raises(PermanentBackendError, match=r"infra/k8s/rbac\.yaml"):
        await backend.launch(launch_spec(KEY))
    apiserver.fail_next("POST", "jobs", 422, reason="Invalid", message="spec.template: Invalid value")
    with pytest.raises(PermanentBackendError, match=r"Kubernetes rejected it: spec\.template: Invalid value"):
        await backend.launch(launch_spec(KEY))
    apiserver.fail_next("DELETE", "jobs", 503)
    with pytest.raises(TemporaryBackendError):
        await backend.cancel(KEY)
    await backend.launch(launch_spec(KEY))
    assert len(apiserver.jobs()) == 1


async def test_an_unreachable_api_server_is_a_temporary_error(make_backend: Make, apiserver: FakeApiServer) -> None:
    backend = make_backend()
    apiserver.stop()
    with pytest.raises(TemporaryBackendError, match="cannot reach the Kubernetes API server"):
        await backend.launch(launch_spec(KEY))


async def test_invalid_launches_are_permanent_errors(backend: KubernetesBackend, apiserver: FakeApiServer) -> None:
    with pytest.raises(PermanentBackendError, match="launch labels"):
        await backend.launch(launch_spec(KEY, labels={"bad label": "x"}))
    with pytest.raises(PermanentBackendError, match="rollout_id"):
        await backend.launch(launch_spec(ExecutionKey("run-1", "has space", "a")))
    assert apiserver.requests == []


async def test_a_bad_template_is_refused_before_any_request(apiserver: FakeApiServer) -> None:
    settings = KubernetesSettings(job_template=TEMPLATE.replace("kind: Job", "kind: Pod"), template_source="t.yaml")
    with pytest.raises(TemplateError, match=r"t\.yaml: must be a batch/v1 Job, got apiVersion 'batch/v1' kind 'Pod'"):
        KubernetesBackend(settings, api_client=apiserver.api_client())
    assert apiserver.requests == []


# --- the creation rate limit ---


class FrozenClock:
    """A clock that only moves when told, and a sleep that records instead of waiting."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 9))
        await asyncio.sleep(0)


async def test_the_token_bucket_spaces_callers_after_the_burst() -> None:
    clock = FrozenClock()
    bucket = TokenBucket(4, burst=2, clock=clock.time, sleep=clock.sleep)
    assert [bucket.reserve() for _ in range(5)] == [0.0, 0.0, 0.25, 0.5, 0.75]
    clock.now += 10  # pays the debt of 3 and refills, but never beyond the burst
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, 0.25]
    waiter = asyncio.create_task(bucket.acquire())
    await asyncio.sleep(0)
    waiter.cancel()  # a cancelled waiter gives its slot back
    await asyncio.gather(waiter, return_exceptions=True)
    assert clock.sleeps == [0.5] and bucket.reserve() == 0.5
    with pytest.raises(ValueError, match="rate must be positive"):
        TokenBucket(0)


async def test_launches_wait_for_the_creation_rate_limit(make_backend: Make, apiserver: FakeApiServer) -> None:
    clock = FrozenClock()
    backend = make_backend(limiter=TokenBucket(5, burst=2, clock=clock.time, sleep=clock.sleep))
    keys = [ExecutionKey("run-1", f"r{i}", "a") for i in range(10)]
    await asyncio.gather(*(backend.launch(launch_spec(k)) for k in keys))
    assert sorted(clock.sleeps) == [0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4, 1.6]  # 2 at once, then 5 per second
    assert apiserver.count("POST", "jobs") == 10 and len(apiserver.jobs()) == 10


async def test_the_rate_limit_comes_from_the_settings(make_backend: Make) -> None:
    limited = make_backend(create_rate=3.0, create_burst=4)
    assert limited.limiter is not None and (limited.limiter.rate, limited.limiter.burst) == (3.0, 4)
    assert make_backend(create_rate=None).limiter is None


# --- settings ---


def test_settings_from_the_environment(tmp_path: Any) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(TEMPLATE)
    settings = KubernetesSettings.from_env(
        {
            "ROLLWIRE_K8S_JOB_TEMPLATE": str(path),
            "ROLLWIRE_K8S_NAMESPACE": "agents",
            "ROLLWIRE_K8S_CREATE_RATE": "0",
            "ROLLWIRE_K8S_CAPACITY": "64",
            "ROLLWIRE_K8S_TEMPLATE_VALUES": '{"service_account": "sa"}',
        }
    )
    assert (settings.namespace, settings.create_rate, settings.capacity) == ("agents", None, 64)
    assert settings.template_values == {"service_account": "sa"} and settings.template_source == str(path)
    with pytest.raises(PermanentBackendError, match="ROLLWIRE_K8S_JOB_TEMPLATE is not set"):
        KubernetesSettings.from_env({})
    with pytest.raises(PermanentBackendError, match="ROLLWIRE_K8S_RESYNC_S='soon' is not a number"):
        KubernetesSettings.from_env({"ROLLWIRE_K8S_JOB_TEMPLATE": str(path), "ROLLWIRE_K8S_RESYNC_S": "soon"})
