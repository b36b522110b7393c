"""The registry's SQLite schema (registry.py), and the migration of an older one."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
    id TEXT PRIMARY KEY, version TEXT NOT NULL, sha256 TEXT NOT NULL, owner TEXT NOT NULL,
    source TEXT NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL, rank INTEGER NOT NULL,
    alpha REAL NOT NULL, rslora INTEGER NOT NULL, targets TEXT NOT NULL, bytes INTEGER NOT NULL,
    config_json TEXT NOT NULL, detail TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS aliases (
    owner TEXT NOT NULL, alias TEXT NOT NULL,
    adapter_id TEXT NOT NULL REFERENCES adapters(id) ON DELETE CASCADE,
    PRIMARY KEY (owner, alias));
CREATE INDEX IF NOT EXISTS aliases_by_adapter ON aliases(adapter_id);
CREATE TABLE IF NOT EXISTS versions (
    id TEXT NOT NULL REFERENCES adapters(id) ON DELETE CASCADE, version TEXT NOT NULL,
    sha256 TEXT NOT NULL, owner TEXT NOT NULL, source TEXT NOT NULL, rank INTEGER NOT NULL,
    alpha REAL NOT NULL, rslora INTEGER NOT NULL, targets TEXT NOT NULL, bytes INTEGER NOT NULL,
    config_json TEXT NOT NULL, detail TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (id, version));
CREATE INDEX IF NOT EXISTS versions_by_version ON versions(version);
CREATE INDEX IF NOT EXISTS adapters_by_version ON adapters(version);
"""
# A registry written before aliases were scoped by owner (alias TEXT PRIMARY KEY): its aliases
# move to their adapters' owners' scopes.
MIGRATE_ALIASES = """
ALTER TABLE aliases RENAME TO aliases_global;
DROP INDEX IF EXISTS aliases_by_adapter;
CREATE TABLE aliases (
    owner TEXT NOT NULL, alias TEXT NOT NULL,
    adapter_id TEXT NOT NULL REFERENCES adapters(id) ON DELETE CASCADE,
    PRIMARY KEY (owner, alias));
INSERT INTO aliases SELECT a.owner, g.alias, g.adapter_id FROM aliases_global g
    JOIN adapters a ON a.id = g.adapter_id;
DROP TABLE aliases_global;
CREATE INDEX aliases_by_adapter ON aliases(adapter_id);
"""
