//! Relation schemas and row images, read from the relcache under the
//! decoding transaction's historic snapshot.
//!
//! Invariants:
//! - A relation's schema lists its live columns in attnum order (dropped
//!   columns and PostgreSQL 18 virtual generated columns skipped) with name,
//!   type OID, typmod and key flag (member of the replica identity index, or
//!   every column under REPLICA IDENTITY FULL), and carries the fingerprint
//!   `trellara_common::fingerprint` computes from exactly those parts.
//! - Cached schemas are dropped when PostgreSQL sends a relcache invalidation
//!   for the relation (or for all relations), the way pgoutput's
//!   RelationSyncCache works, so a schema change inside a decoded
//!   transaction is seen by the next change.
//! - Values: NULL is `null`; an on-disk TOAST pointer in a new tuple (an
//!   unchanged TOASTed column of an UPDATE) is `unchanged_toast` and is never
//!   detoasted; everything else is the type's text output.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CStr;
use std::rc::Rc;

use pgrx::pg_sys;
use trellara_common::envelope::{ColumnSchema, RelationSchema, ReplicaIdentity, Value, value};
use trellara_common::fingerprint::fingerprint;

use crate::error::PluginError;

/// One live column: where it is in the tuple and how to print it.
#[derive(Debug, Clone)]
struct Column {
    /// 0-based index in the relation's tuple descriptor.
    index: usize,
    attlen: i16,
    typoutput: pg_sys::Oid,
    is_varlena: bool,
    key: bool,
}

/// A relation's schema as the envelope carries it, plus what row decoding needs.
#[derive(Debug)]
pub struct RelationInfo {
    pub schema: RelationSchema,
    /// `schema` encoded, for envelope size planning.
    pub encoded_len: usize,
    pub identity: ReplicaIdentity,
    columns: Vec<Column>,
    /// Attribute count of the descriptor the columns index into.
    natts: usize,
    built_at: u64,
}

/// Relcache invalidations seen by this backend, as epochs.
#[derive(Debug, Default)]
struct Invalidations {
    epoch: u64,
    all: u64,
    per_relation: HashMap<u32, u64>,
}

thread_local! {
    static INVALIDATIONS: RefCell<Invalidations> = RefCell::new(Invalidations::default());
    static CALLBACK_REGISTERED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Called by PostgreSQL for every relcache invalidation (`relid` 0 = all).
#[pgrx::pg_guard]
unsafe extern "C-unwind" fn relcache_invalidated(_arg: pg_sys::Datum, relid: pg_sys::Oid) {
    INVALIDATIONS.with(|cell| {
        if let Ok(mut inv) = cell.try_borrow_mut() {
            inv.epoch += 1;
            let epoch = inv.epoch;
            if relid == pg_sys::InvalidOid {
                inv.all = epoch;
            } else {
                inv.per_relation.insert(relid.to_u32(), epoch);
            }
        }
    });
}

fn current_epoch() -> u64 {
    INVALIDATIONS.with(|cell| cell.try_borrow().map(|inv| inv.epoch).unwrap_or(u64::MAX))
}

fn still_valid(info: &RelationInfo) -> bool {
    let oid = info.schema.relation_id;
    INVALIDATIONS.with(|cell| match cell.try_borrow() {
        Ok(inv) => {
            let last = inv
                .per_relation
                .get(&oid)
                .copied()
                .unwrap_or(0)
                .max(inv.all);
            last < info.built_at
        }
        Err(_) => false,
    })
}

/// Registers the relcache callback once per backend process.
pub fn register_invalidation_callback() {
    if CALLBACK_REGISTERED.with(|r| r.replace(true)) {
        return;
    }
    // Start at epoch 1 so an entry built now (built_at = 1) is valid until
    // an invalidation moves the epoch past it.
    INVALIDATIONS.with(|cell| {
        if let Ok(mut inv) = cell.try_borrow_mut() {
            inv.epoch = inv.epoch.max(1);
        }
    });
    // SAFETY: registering a relcache callback is allowed at any time in a
    // backend; the callback is a #[pg_guard] fn living as long as the
    // library (never unloaded), and PostgreSQL passes it a valid OID.
    unsafe {
        pg_sys::CacheRegisterRelcacheCallback(Some(relcache_invalidated), pg_sys::Datum::from(0))
    };
}

/// Schemas by relation OID for one decoding context.
#[derive(Debug, Default)]
pub struct RelationCache {
    entries: HashMap<u32, Rc<RelationInfo>>,
}

fn identity_of(relreplident: u8) -> ReplicaIdentity {
    match relreplident {
        pg_sys::REPLICA_IDENTITY_DEFAULT => ReplicaIdentity::Default,
        pg_sys::REPLICA_IDENTITY_NOTHING => ReplicaIdentity::Nothing,
        pg_sys::REPLICA_IDENTITY_FULL => ReplicaIdentity::Full,
        pg_sys::REPLICA_IDENTITY_INDEX => ReplicaIdentity::Index,
        _ => ReplicaIdentity::Unspecified,
    }
}

/// `char *` from PostgreSQL to an owned String (lossless for UTF-8 databases,
/// which startup enforces).
///
/// # Safety
/// `ptr` must be NULL or a NUL-terminated string.
pub unsafe fn owned_str(ptr: *const std::ffi::c_char, what: &str) -> Result<String, PluginError> {
    if ptr.is_null() {
        return Err(PluginError::internal(format!("trellara: {what} is NULL")));
    }
    // SAFETY: the caller guarantees a NUL-terminated string.
    let cstr = unsafe { CStr::from_ptr(ptr) };
    cstr.to_str().map(str::to_owned).map_err(|_| {
        PluginError::new(
            pg_sys::errcodes::PgSqlErrorCode::ERRCODE_CHARACTER_NOT_IN_REPERTOIRE,
            format!("trellara: {what} is not valid UTF-8"),
        )
    })
}

impl RelationCache {
    /// The schema of `rel` as the decoding snapshot sees it now.
    ///
    /// # Safety
    /// `rel` must be a valid open relation handed to an output plugin
    /// callback, and the call must run inside the decoding transaction.
    pub unsafe fn get(&mut self, rel: pg_sys::Relation) -> Result<Rc<RelationInfo>, PluginError> {
        // SAFETY: rel is valid per the contract.
        let oid = unsafe { (*rel).rd_id }.to_u32();
        if let Some(info) = self.entries.get(&oid)
            && still_valid(info)
        {
            return Ok(Rc::clone(info));
        }
        // SAFETY: as above.
        let info = Rc::new(unsafe { build(rel) }?);
        self.entries.insert(oid, Rc::clone(&info));
        Ok(info)
    }
}

/// Reads the relation's schema from the relcache and catalogs.
///
/// # Safety
/// Same as [`RelationCache::get`].
unsafe fn build(rel: pg_sys::Relation) -> Result<RelationInfo, PluginError> {
    let built_at = current_epoch();
    // SAFETY: rel, rd_rel and rd_att are valid for an open relation.
    let (oid, form, tupdesc) = unsafe { ((*rel).rd_id, &*(*rel).rd_rel, (*rel).rd_att) };
    let name = pg_sys::name_data_to_str(&form.relname).to_owned();
    // SAFETY: catalog lookup inside the decoding transaction; returns a
    // palloc'd string (or NULL for a vanished namespace).
    let nsp = unsafe { pg_sys::get_namespace_name(form.relnamespace) };
    // SAFETY: NULL or a NUL-terminated palloc'd string.
    let namespace = unsafe { owned_str(nsp, "namespace name") }?;
    let identity = identity_of(form.relreplident as u8);
    // SAFETY: rel is valid; the bitmap is palloc'd in the current context.
    let key_bitmap = match identity {
        ReplicaIdentity::Default | ReplicaIdentity::Index => unsafe {
            pg_sys::RelationGetIdentityKeyBitmap(rel)
        },
        _ => std::ptr::null_mut(),
    };
    // SAFETY: rd_att is the relation's valid descriptor; not freed by us.
    let desc = unsafe { pgrx::PgTupleDesc::from_pg_unchecked(tupdesc) };
    let mut columns = Vec::new();
    let mut schema_columns = Vec::new();
    for index in 0..desc.len() {
        let Some(att) = desc.get(index) else { continue };
        if att.attisdropped || att.attnum <= 0 || att.attgenerated as u8 == b'v' {
            continue;
        }
        let key = match identity {
            ReplicaIdentity::Full => true,
            // SAFETY: bms_is_member accepts NULL (empty set).
            _ => unsafe {
                pg_sys::bms_is_member(
                    i32::from(att.attnum) - pg_sys::FirstLowInvalidHeapAttributeNumber,
                    key_bitmap,
                )
            },
        };
        let (mut typoutput, mut is_varlena) = (pg_sys::InvalidOid, false);
        // SAFETY: syscache lookup for a valid type OID, inside a transaction;
        // ERRORs (as a Rust panic through pgrx's guard) if the type is gone.
        unsafe { pg_sys::getTypeOutputInfo(att.atttypid, &mut typoutput, &mut is_varlena) };
        columns.push(Column {
            index,
            attlen: att.attlen,
            typoutput,
            is_varlena,
            key,
        });
        schema_columns.push(ColumnSchema {
            name: pg_sys::name_data_to_str(&att.attname).to_owned(),
            type_oid: att.atttypid.to_u32(),
            type_modifier: att.atttypmod,
            key,
        });
    }
    let mut schema = RelationSchema {
        relation_id: oid.to_u32(),
        namespace,
        name,
        replica_identity: identity as i32,
        columns: schema_columns,
        fingerprint: 0,
    };
    schema.fingerprint = fingerprint(&schema);
    let encoded_len = prost::Message::encoded_len(&schema);
    Ok(RelationInfo {
        schema,
        encoded_len,
        identity,
        columns,
        natts: desc.len(),
        built_at,
    })
}

/// Which image a tuple is, which decides how its values are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Image {
    /// A new tuple (insert, update): on-disk TOAST pointers are unchanged values.
    New,
    /// An old tuple with every column (REPLICA IDENTITY FULL).
    OldFull,
    /// An old tuple holding only the key columns: the others are `absent`.
    OldKey,
}

fn kind(kind: value::Kind) -> Value {
    Value { kind: Some(kind) }
}

/// Whether a varlena datum is an on-disk TOAST pointer (VARATT_IS_EXTERNAL_ONDISK).
///
/// # Safety
/// `datum` must be a non-NULL varlena datum.
unsafe fn is_external_ondisk(datum: pg_sys::Datum) -> bool {
    let ptr = datum.cast_mut_ptr::<pg_sys::varlena>();
    // SAFETY: ptr points at a varlena header per the contract.
    unsafe {
        pgrx::varlena::varatt_is_1b_e(ptr)
            && pgrx::varlena::vartag_external(ptr) == pg_sys::vartag_external::VARTAG_ONDISK as u8
    }
}

/// Scratch arrays for heap_deform_tuple, reused across changes.
#[derive(Debug, Default)]
pub struct Deformer {
    values: Vec<pg_sys::Datum>,
    nulls: Vec<bool>,
}

impl Deformer {
    /// The image's values in the relation's column order.
    ///
    /// # Safety
    /// `tuple` must be a valid heap tuple of `rel`, whose schema `info` was
    /// read for (`info` must be current), inside the decoding transaction
    /// with CurrentMemoryContext a short-lived context.
    pub unsafe fn values(
        &mut self,
        rel: pg_sys::Relation,
        info: &RelationInfo,
        tuple: pg_sys::HeapTuple,
        image: Image,
    ) -> Result<Vec<Value>, PluginError> {
        // SAFETY: rel is valid per the contract.
        let tupdesc = unsafe { (*rel).rd_att };
        // SAFETY: tupdesc is valid.
        let natts = usize::try_from(unsafe { (*tupdesc).natts }).unwrap_or(0);
        if natts != info.natts {
            return Err(PluginError::internal(format!(
                "trellara: relation {}.{} has {natts} attributes, its cached schema {}",
                info.schema.namespace, info.schema.name, info.natts
            )));
        }
        self.values.clear();
        self.values.resize(natts, pg_sys::Datum::from(0));
        self.nulls.clear();
        self.nulls.resize(natts, true);
        // SAFETY: arrays have natts entries; tuple matches tupdesc.
        unsafe {
            pg_sys::heap_deform_tuple(
                tuple,
                tupdesc,
                self.values.as_mut_ptr(),
                self.nulls.as_mut_ptr(),
            )
        };
        let mut out = Vec::with_capacity(info.columns.len());
        for column in &info.columns {
            if image == Image::OldKey && !column.key {
                out.push(kind(value::Kind::Absent(true)));
                continue;
            }
            let (Some(&datum), Some(&null)) =
                (self.values.get(column.index), self.nulls.get(column.index))
            else {
                return Err(PluginError::internal("trellara: column index out of range"));
            };
            if null {
                out.push(kind(value::Kind::Null(true)));
                continue;
            }
            // SAFETY: attlen -1 means a varlena datum, non-NULL here.
            if column.attlen == -1 && unsafe { is_external_ondisk(datum) } {
                // Never detoast: the TOAST rows may already be gone. Only a
                // new image can legitimately hold one; envelope validation
                // refuses it anywhere else.
                out.push(kind(value::Kind::UnchangedToast(true)));
                continue;
            }
            let datum = if column.is_varlena {
                // SAFETY: a non-NULL varlena datum; detoasting inline
                // compressed or indirect values is what the output
                // function expects (PG_DETOAST_DATUM).
                pg_sys::Datum::from(unsafe {
                    pg_sys::pg_detoast_datum(datum.cast_mut_ptr::<pg_sys::varlena>())
                })
            } else {
                datum
            };
            // SAFETY: typoutput is the column type's output function; the
            // result is a palloc'd C string in the short-lived context.
            let text = unsafe { pg_sys::OidOutputFunctionCall(column.typoutput, datum) };
            // SAFETY: output functions return NUL-terminated strings.
            let text = unsafe { owned_str(text, "column value") }?;
            out.push(kind(value::Kind::Text(text)));
        }
        Ok(out)
    }
}
