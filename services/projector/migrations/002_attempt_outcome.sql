-- How each attempt ended, as the contract's rollout fold (`schemas.rollout`) tells it: whether it
-- reached `running`, the status that ended it and that status's reason.
ALTER TABLE attempts
    ADD COLUMN reached_running boolean NOT NULL DEFAULT false,
    ADD COLUMN ended_as        text,
    ADD COLUMN reason          text;
