"""The agent of the operations tests: one streamed model call, then a reward, or exit 3 when told to fail."""

import json
import os
import sys
import time

import httpx
import openai

task = json.loads(os.environ["ROLLWIRE_INPUT"])
client = openai.OpenAI()
stream = client.chat.completions.create(
    model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True
)
for _ in stream:
    pass
time.sleep(1.5)  # long enough for the controller (and a scrape) to see the execution running
if task.get("fail"):
    sys.exit(3)
headers = {"Authorization": f"Bearer {os.environ['ROLLWIRE_TOKEN']}"}
httpx.post(os.environ["ROLLWIRE_EVENTS_URL"], json={"type": "reward", "value": 1.0}, headers=headers, timeout=30)
