#!/bin/sh
# Codex CLI as a Rollwire agent: `codex` with its model provider built from the attempt's environment.
#
# Codex ignores OPENAI_BASE_URL: with the controller's variables alone it tries OpenAI's Responses
# WebSocket and hangs. This wrapper adds a provider named `rollwire` whose base URL is
# $OPENAI_BASE_URL (the attempt's proxy) and whose key is read from $OPENAI_API_KEY (the attempt
# token), over the Responses API, with Codex's update check, analytics and feedback off:
#
#     RunSpec(run_id="r1", command=["sh", "examples/codex/codex.sh", "exec", "--skip-git-repo-check",
#             "--dangerously-bypass-approvals-and-sandbox", "Fix the failing test."])
#
# Every argument goes to codex (`exec ...` runs one headless turn). $CODEX names the executable
# (default: `codex` on PATH). The model is named $CODEX_MODEL (default `default`; `-m NAME` also
# works): the proxy sends a name the run has not registered to the run's model. Codex's own default
# model (a gpt-5 codex model) makes it send OpenAI-only input items (`additional_tools`) that the
# proxy refuses with a 422, so the wrapper does not leave the model unset.
set -eu
base_url="${OPENAI_BASE_URL:?is not set: run this as the agent of a rollout (the controller sets it)}"
: "${OPENAI_API_KEY:?is not set: run this as the agent of a rollout (the controller sets it)}"
case $base_url in
  http://* | https://*) ;;
  *) echo "codex.sh: OPENAI_BASE_URL is not an http(s) URL: $base_url" >&2; exit 2 ;;
esac
if printf '%s' "$base_url" | grep -q '["\\[:space:]]' || [ "$(printf '%s' "$base_url" | wc -l)" -ne 0 ]; then
  echo "codex.sh: OPENAI_BASE_URL holds a quote, backslash or space: $base_url" >&2
  exit 2
fi
model="${CODEX_MODEL:-default}"
if printf '%s' "$model" | grep -q '["\\[:space:]]'; then
  echo "codex.sh: CODEX_MODEL holds a quote, backslash or space: $model" >&2
  exit 2
fi
exec "${CODEX:-codex}" \
  -c "model=\"$model\"" -c model_provider=rollwire \
  -c "model_providers.rollwire={name=\"rollwire\", base_url=\"$base_url\", env_key=\"OPENAI_API_KEY\", wire_api=\"responses\"}" \
  -c check_for_update_on_startup=false -c analytics.enabled=false -c feedback.enabled=false \
  "$@"
