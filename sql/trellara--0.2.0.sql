-- trellara 0.2.0: install script for CREATE EXTENSION trellara.
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

-- The native capture worker's state, straight from shared memory.
CREATE FUNCTION @extschema@.status_raw(
    OUT state text,
    OUT reason text,
    OUT pid integer,
    OUT queue_occupancy integer,
    OUT queue_capacity integer,
    OUT last_acknowledged_lsn bigint,
    OUT frames_sent bigint,
    OUT acknowledgements bigint)
    RETURNS SETOF record
    LANGUAGE c VOLATILE STRICT
    AS 'MODULE_PATHNAME', 'status_raw_wrapper';

-- The native capture pipeline's state: not_loaded (trellara is not in
-- shared_preload_libraries), not_running, starting, running,
-- waiting_for_relay, backpressured, failed_closed or stopped; why; the
-- worker's pid; the shared-memory queue's occupancy and capacity (frames of
-- up to 64 KiB); the last LSN the relay acknowledged as durable (the slot's
-- confirmed_flush follows it); frames written to the relay; acknowledgements.
CREATE FUNCTION @extschema@.status(
    OUT state text,
    OUT reason text,
    OUT pid integer,
    OUT queue_occupancy integer,
    OUT queue_capacity integer,
    OUT last_acknowledged_lsn pg_lsn,
    OUT frames_sent bigint,
    OUT acknowledgements bigint)
    RETURNS record
    LANGUAGE sql VOLATILE
    AS $$
        SELECT state, reason, pid, queue_occupancy, queue_capacity,
               '0/0'::pg_lsn + last_acknowledged_lsn::numeric,
               frames_sent, acknowledgements
          FROM @extschema@.status_raw()
    $$;

COMMENT ON FUNCTION @extschema@.status() IS
    'Native capture state: state, reason, pid, queue occupancy/capacity, last LSN the relay acknowledged, frames sent, acknowledgements';

-- Starts a capture worker for the current database, configured by the
-- trellara.* settings in the configuration files (ALTER SYSTEM SET
-- trellara.slot/source_id/socket_path ...; the worker rereads them).
-- Returns its pid. Needs shared_preload_libraries = 'trellara'.
CREATE FUNCTION @extschema@.start_worker() RETURNS integer
    LANGUAGE c VOLATILE STRICT
    AS 'MODULE_PATHNAME', 'start_worker_wrapper';

-- Stops the capture worker (it is not restarted until start_worker() or a
-- server restart); the slot stays at the relay's last acknowledgement.
-- Returns whether a worker was running.
CREATE FUNCTION @extschema@.stop_worker() RETURNS boolean
    LANGUAGE c VOLATILE STRICT
    AS 'MODULE_PATHNAME', 'stop_worker_wrapper';

REVOKE ALL ON FUNCTION @extschema@.start_worker() FROM PUBLIC;
REVOKE ALL ON FUNCTION @extschema@.stop_worker() FROM PUBLIC;
