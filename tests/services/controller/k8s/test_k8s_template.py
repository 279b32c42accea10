"""Job templates: deterministic names, the rendered manifest's fields, and clear template errors."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from k8s_support import TEMPLATE, launch_spec

from services.controller.backends.base import (
    INPUT_ENV,
    INPUT_ENV_LIMIT,
    ExecutionKey,
    LaunchSpec,
    PermanentBackendError,
)
from services.controller.backends.k8s_secret import credentials, secret_manifest
from services.controller.backends.k8s_template import (
    INPUT_ANNOTATION,
    INPUT_ANNOTATION_LIMIT,
    INPUT_FILE,
    JobTemplate,
    TemplateError,
    job_name,
    key_of,
    label_problem,
    label_value,
    validate_manifest,
)

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
KEY = ExecutionKey("run-1", "rollout-7", "attempt-2")
# Ids as schemas/ids.py allows them: no '.', '*', '>', '/', whitespace.
ids = st.text(
    alphabet=st.characters(blacklist_characters="./*> \t\n\r\x0b\x0c", blacklist_categories=("Cs", "Zs", "Cc")),
    min_size=1,
    max_size=128,
)


def template(text: str = TEMPLATE, **kwargs: Any) -> JobTemplate:
    kwargs.setdefault("namespace", "agents")
    kwargs.setdefault("image", "registry.example/agent:1")
    return JobTemplate(text, source="test.yaml", **kwargs)


def env_of(container: dict[str, Any], spec: LaunchSpec | None = None) -> dict[str, str]:
    """A container's environment; credentials resolved from the attempt's Secret (`spec` gives its data)."""
    secret = credentials(spec) if spec is not None else {}
    env = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            assert spec is None or ref["name"] == job_name(spec.key)
            env[e["name"]] = secret.get(ref["key"], f"<secret {ref['key']}>")
        else:
            env[e["name"]] = e["value"]
    return env


def test_credentials_are_secret_references_never_values() -> None:
    spec = launch_spec(KEY, evaluator_command=["grade"], evaluator_env={"ROLLWIRE_TOKEN": "eval-token"})
    job = template(SIDECAR_TEMPLATE).render(spec)
    text = json.dumps(job)
    assert "agent-token" not in text and "eval-token" not in text
    assert credentials(spec) == {
        "agent.OPENAI_API_KEY": "agent-token",
        "evaluator.ROLLWIRE_TOKEN": "eval-token",
    }
    secret = secret_manifest(spec, job_name(KEY), "agents", "default", {"name": job_name(KEY), "uid": "u-1"})
    validate_manifest(secret, "1.33")
    assert secret["metadata"]["ownerReferences"][0] == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": job_name(KEY),
        "uid": "u-1",
    }
    assert base64.b64decode(secret["data"]["evaluator.ROLLWIRE_TOKEN"]) == b"eval-token"
    assert key_of(secret) == KEY


# --- names and labels ---


def test_job_names_are_deterministic_dns_labels_with_a_hash() -> None:
    name = job_name(KEY)
    assert name == job_name(ExecutionKey("run-1", "rollout-7", "attempt-2"))
    assert name.startswith("rw-run-1-rollout-7-attempt-2-")
    assert DNS_LABEL.match(name) and len(name) <= 63
    long = ExecutionKey("R" * 128, "Rollout_With:Odd#Chars" * 5, "a" * 100)
    assert DNS_LABEL.match(job_name(long)) and len(job_name(long)) == 63
    # The readable part alone would be ambiguous; the hash keeps the names apart.
    assert job_name(ExecutionKey("a-b", "c", "x")) != job_name(ExecutionKey("a", "b-c", "x"))
    assert job_name(ExecutionKey("R", "x", "y")) != job_name(ExecutionKey("r", "x", "y"))


@settings(max_examples=100, derandomize=True, deadline=None)
@given(ids, ids, ids, ids)
def test_any_ids_give_a_valid_distinct_job_name(run: str, rollout: str, attempt: str, other: str) -> None:
    key = ExecutionKey(run, rollout, attempt)
    name = job_name(key)
    assert DNS_LABEL.match(name) and len(name) <= 63
    assert job_name(ExecutionKey(run, rollout, attempt)) == name
    if other != attempt:
        assert job_name(ExecutionKey(run, rollout, other)) != name
    assert label_problem("rollwire.dev/rollout", label_value(rollout)) is None


def test_label_values_keep_valid_ids_and_hash_the_rest() -> None:
    assert label_value("rollout-7") == "rollout-7"
    odd = label_value("has:colons#and" + "x" * 80)
    assert label_problem("k", odd) is None and len(odd) <= 63
    assert odd != label_value("has:colons#and" + "x" * 81)


# --- rendering ---


def test_rendered_job_has_the_backend_owned_fields_and_validates() -> None:
    launch = launch_spec(KEY, timeout_s=90.5)
    job = template(ttl_seconds_after_finished=900).render(launch)
    validate_manifest(job, "1.33")
    name = job_name(KEY)
    meta = job["metadata"]
    assert (meta["name"], meta["namespace"]) == (name, "agents")
    owned = {
        "app.kubernetes.io/managed-by": "rollwire",
        "rollwire.dev/instance": "default",
        "rollwire.dev/run": "run-1",
        "rollwire.dev/rollout": "rollout-7",
        "rollwire.dev/attempt": "attempt-2",
    }
    assert owned.items() <= meta["labels"].items()
    assert meta["labels"]["app.kubernetes.io/name"] == "rollwire-agent"  # the template's own label stays
    assert key_of(job) == KEY
    spec = job["spec"]
    assert spec["backoffLimit"] == 0
    assert spec["activeDeadlineSeconds"] == 91
    assert spec["ttlSecondsAfterFinished"] == 900  # `{{ ttl_seconds_after_finished }}` kept its int type
    pod_meta = spec["template"]["metadata"]
    assert owned.items() <= pod_meta["labels"].items()
    assert pod_meta["labels"]["app.kubernetes.io/component"] == "agent"
    assert pod_meta["annotations"][INPUT_ANNOTATION] == '{"question": "2+2"}'
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert pod["automountServiceAccountToken"] is False
    (agent,) = pod["containers"]
    assert agent["image"] == "registry.example/agent:1"
    env = env_of(agent, launch)
    assert env["OPENAI_API_KEY"] == "agent-token"
    assert env[INPUT_ENV] == '{"question": "2+2"}'
    assert env["ROLLWIRE_INPUT_FILE"] == INPUT_FILE
    assert {"name": "rollwire-input", "mountPath": "/var/run/rollwire", "readOnly": True} in agent["volumeMounts"]
    assert {"name": "workspace", "mountPath": "/workspace"} in agent["volumeMounts"]
    (input_volume,) = [v for v in pod["volumes"] if v["name"] == "rollwire-input"]
    assert INPUT_ANNOTATION in input_volume["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"]


SIDECAR_TEMPLATE = """
apiVersion: batch/v1
kind: Job
metadata:
  labels: {team: rl}
spec:
  template:
    spec:
      initContainers:
        - name: fetch-repo
          image: alpine/git
          env: [{name: OPENAI_API_KEY, value: overridden}]
      containers:
        - name: sandbox
          image: sandbox:2
        - name: agent
          image: "{{ image }}"
          args: ["--old"]
          readinessProbe: {exec: {command: ["true"]}}
          env: [{name: KEEP, value: "1"}]
"""


def test_env_goes_into_every_container_and_the_command_replaces_the_agents() -> None:
    spec = launch_spec(KEY, command=["python", "-m", "agent"], labels={"team": "rl-2"})
    job = template(SIDECAR_TEMPLATE).render(spec)
    validate_manifest(job, "1.33")
    pod = job["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in [*pod["initContainers"], *pod["containers"]]}
    for container in containers.values():
        assert env_of(container, spec)["OPENAI_API_KEY"] == "agent-token"
        assert env_of(container, spec)[INPUT_ENV] == '{"question": "2+2"}'
    assert env_of(containers["agent"], spec)["KEEP"] == "1"
    assert containers["agent"]["command"] == ["python", "-m", "agent"] and "args" not in containers["agent"]
    assert "command" not in containers["sandbox"]
    assert job["metadata"]["labels"]["team"] == "rl-2"


def test_an_evaluator_runs_after_the_agent_with_its_own_token() -> None:
    spec = launch_spec(KEY, evaluator_command=["python", "-m", "grade"], evaluator_env={"ROLLWIRE_TOKEN": "eval-token"})
    job = template(SIDECAR_TEMPLATE).render(spec)
    validate_manifest(job, "1.33")
    pod = job["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-repo", "agent"]
    assert [c["name"] for c in pod["containers"]] == ["sandbox", "evaluator"]
    agent, evaluator = pod["initContainers"][1], pod["containers"][1]
    assert "readinessProbe" not in agent  # not allowed on init containers
    assert evaluator["command"] == ["python", "-m", "grade"] and evaluator["image"] == "registry.example/agent:1"
    assert env_of(evaluator, spec)["ROLLWIRE_TOKEN"] == "eval-token"
    assert "OPENAI_API_KEY" not in env_of(evaluator, spec)
    assert all("eval-token" not in env_of(c, spec).values() for c in [*pod["initContainers"], pod["containers"][0]])
    assert env_of(evaluator, spec)[INPUT_ENV] == '{"question": "2+2"}'


def test_large_inputs_go_by_file_only_and_huge_ones_are_refused() -> None:
    large = '"' + "x" * (INPUT_ENV_LIMIT + 10) + '"'
    job = template().render(launch_spec(KEY, input_json=large))
    (agent,) = job["spec"]["template"]["spec"]["containers"]
    assert INPUT_ENV not in env_of(agent) and env_of(agent)["ROLLWIRE_INPUT_FILE"] == INPUT_FILE
    assert job["spec"]["template"]["metadata"]["annotations"][INPUT_ANNOTATION] == large
    with pytest.raises(PermanentBackendError, match="object store"):
        template().render(launch_spec(KEY, input_json="x" * (INPUT_ANNOTATION_LIMIT + 1)))


def test_ids_cannot_change_the_manifest_structure() -> None:
    text = TEMPLATE.replace(
        "    app.kubernetes.io/name: rollwire-agent\nspec:",
        "    app.kubernetes.io/name: rollwire-agent\n"
        "  annotations:\n    note: run {{ run_id }} of {{ rollout_id }}\nspec:",
    )
    evil = ExecutionKey("r1", 'x: {y: 1}\n#"', "a1")
    with pytest.raises(PermanentBackendError, match="rollout_id"):
        template(text).render(launch_spec(evil))  # newlines are not valid ids at all
    evil = ExecutionKey("r1", 'x:{y:1}#"]', "a1")
    job = template(text).render(launch_spec(evil))
    assert job["metadata"]["annotations"]["note"] == 'run r1 of x:{y:1}#"]'
    assert job["metadata"]["annotations"]["rollwire.dev/rollout-id"] == 'x:{y:1}#"]'
    validate_manifest(job, "1.33")


def test_template_values_fill_custom_placeholders() -> None:
    text = TEMPLATE.replace("automountServiceAccountToken: false", "serviceAccountName: {{ service_account }}")
    job = template(text, values={"service_account": "agents-sa"}).render(launch_spec(KEY))
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "agents-sa"
    assert job["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_an_image_placeholder_without_an_image_is_a_permanent_error() -> None:
    with pytest.raises(PermanentBackendError, match="image"):
        template(image=None).render(launch_spec(KEY))
    job = template(image=None).render(launch_spec(KEY, image="per-run:3"))
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "per-run:3"


# --- template errors ---

JOB = """
apiVersion: batch/v1
kind: Job
spec:
  template:
    spec:
      containers:
        - name: agent
          image: "{{ image }}"
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (JOB.replace("kind: Job", "kind: Deployment").replace("batch/v1", "apps/v1"), "must be a batch/v1 Job"),
        (JOB + "  - broken: [\n", "line 10: not valid YAML"),
        (JOB.replace("{{ image }}", "{{ imagee }}"), "unknown placeholder(s) imagee; allowed: attempt_id, image,"),
        (JOB.replace("{{ image }}", "{{ .Values.image }}"), "unsupported placeholder syntax"),
        (JOB.replace("spec:\n  template", "spec:\n  backoffLimit: 3\n  template", 1), "backoffLimit is 3"),
        (JOB.replace("    spec:\n", "    spec:\n      restartPolicy: OnFailure\n"), "restartPolicy is 'OnFailure'"),
        (JOB.replace("kind: Job", "kind: Job\nmetadata:\n  name: fixed"), "metadata.name is 'fixed'"),
        (JOB.replace("kind: Job", "kind: Job\nmetadata:\n  namespace: prod"), "metadata.namespace is 'prod'"),
        (JOB.replace("spec:\n  template", "spec:\n  parallelism: 4\n  template", 1), "spec.parallelism is 4"),
        (JOB.replace("      containers:\n        - name: agent\n", "      containers: []\n        # "), "containers"),
        (JOB + "---\n" + JOB, "exactly one YAML mapping"),
        (JOB.replace("image: ", "imagePullPolicyy: Always\n          image: "), "spec.template.spec.containers[0]"),
        (JOB.replace("spec:\n  template", "spec:\n  ttlSecondsAfterFinished: soon\n  template", 1), "'soon' is not"),
    ],
)
def test_template_errors_say_where_and_what(text: str, expected: str) -> None:
    with pytest.raises(TemplateError) as error:
        template(text)
    message = str(error.value)
    assert message.startswith("test.yaml: ")
    assert expected in message


def test_schema_errors_name_the_field_and_the_kubernetes_version() -> None:
    text = JOB.replace("image: ", "imagePullPolicyy: Always\n          image: ")
    with pytest.raises(
        TemplateError, match=r"Kubernetes 1\.33: spec\.template\.spec\.containers\[0\].*imagePullPolicyy"
    ):
        template(text)


def test_the_agent_container_must_exist() -> None:
    with pytest.raises(TemplateError, match=r"agent container 'main' is not in the template; containers: \['agent'\]"):
        template(JOB, agent_container="main")
    assert template(SIDECAR_TEMPLATE).agent_container == "agent"
    assert template(SIDECAR_TEMPLATE, agent_container="sandbox").agent_container == "sandbox"


def test_placeholders_in_comments_are_ignored() -> None:
    template("# write {{ anything }} here\n" + JOB)
