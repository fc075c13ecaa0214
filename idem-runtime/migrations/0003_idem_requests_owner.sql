-- External mode: the claim carries its owner's token, so that a claim whose
-- answer was lost is recognised by its own request on the next attempt (and
-- resumed) instead of being reported as "may have reached the target", and
-- so that recording an outcome only ever touches the owner's own claim.
ALTER TABLE idem_requests ADD COLUMN owner bytea CHECK (owner IS NULL OR octet_length(owner) = 16);

COMMENT ON COLUMN idem_requests.owner IS 'external mode: a random token of the request holding the claim (NULL in local mode, whose claim is never seen in progress)';
