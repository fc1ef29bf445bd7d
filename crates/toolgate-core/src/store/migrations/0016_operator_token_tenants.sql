-- 0016: operator tokens are scoped to tenants (issue 33 Medium 4). NULL means
-- every tenant: what every operator token made before this migration could
-- reach, so an upgrade changes no token's reach; a new operator token states
-- its tenants (`--tenant T`, repeatable) or `--all-tenants`. The tenants are
-- kept comma-separated (tenant ids hold no comma). Subject tokens keep NULL:
-- their `tenant` column is their scope.
ALTER TABLE api_tokens ADD COLUMN operator_tenants TEXT;
