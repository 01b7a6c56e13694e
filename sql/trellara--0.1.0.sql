-- trellara 0.1.0: install script for CREATE EXTENSION trellara.
--
-- The control file (extension/trellara.control) sets schema = trellara, so
-- PostgreSQL creates the schema and @extschema@ is trellara. The C functions
-- are bound by symbol name to the Rust functions in extension/src/lib.rs
-- (#[pg_extern(sql = false)] exports <name>_wrapper).

\echo Use "CREATE EXTENSION trellara" to load this file. \quit

-- The version of the loaded trellara library, e.g. '0.1.0'.
CREATE FUNCTION @extschema@.extension_version() RETURNS text
    LANGUAGE c IMMUTABLE STRICT PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'extension_version_wrapper';

-- The envelope protocol version the output plugin emits (1).
CREATE FUNCTION @extschema@.protocol_version() RETURNS integer
    LANGUAGE c IMMUTABLE STRICT PARALLEL SAFE
    AS 'MODULE_PATHNAME', 'protocol_version_wrapper';

-- The native capture pipeline's state. Until the background worker, the
-- shared-memory queue and the relay socket exist (issue 3 part 2) this says
-- so, with NULLs instead of invented numbers. Part 2 replaces it with a C
-- function through an upgrade script (see sql/README.md).
CREATE FUNCTION @extschema@.status(
    OUT state text,
    OUT reason text,
    OUT queue_occupancy integer,
    OUT queue_capacity integer,
    OUT last_acknowledged_lsn pg_lsn)
    RETURNS record
    LANGUAGE sql STABLE PARALLEL SAFE
    AS $$
        SELECT 'not_running'::text,
               'background worker not built yet (issue 3 part 2)'::text,
               NULL::integer,
               NULL::integer,
               NULL::pg_lsn
    $$;

COMMENT ON FUNCTION @extschema@.status() IS
    'Native capture state: state, reason, queue occupancy/capacity, last LSN the relay acknowledged';
