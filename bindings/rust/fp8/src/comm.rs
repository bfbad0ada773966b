//! Data parallelism: communicators (fp8.h, "Data parallelism").

use crate::context::Context;
use crate::error::{check, created, Error, Result, Status};
use fp8_sys as sys;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};

/// The id that joins the ranks of a group (an ncclUniqueId, 128 bytes): made on one rank
/// (`CommId::new`), handed to every rank by the launcher.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct CommId(pub [u8; sys::FP8_COMM_ID_BYTES]);

impl CommId {
    /// A new id for one group (`fp8_comm_get_id`).
    pub fn new() -> Result<CommId> {
        let mut id = sys::fp8_comm_id_t { bytes: [0; sys::FP8_COMM_ID_BYTES] };
        check(unsafe { sys::fp8_comm_get_id(&mut id) })?;
        Ok(CommId(id.bytes))
    }
}

impl std::fmt::Debug for CommId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CommId(..)")
    }
}

/// One rank's end of a group, on its context (which it borrows).
pub struct Comm<'c> {
    raw: NonNull<sys::fp8_comm_t>,
    _ctx: PhantomData<&'c Context>,
}

impl<'c> Comm<'c> {
    /// Joins the group of `id` as `rank` of `nranks` on `ctx`'s CUDA device (one process per
    /// rank); blocks until every rank has joined.
    pub fn create(ctx: &'c Context, nranks: i32, rank: i32, id: &CommId) -> Result<Comm<'c>> {
        let raw_id = sys::fp8_comm_id_t { bytes: id.0 };
        let mut raw = ptr::null_mut();
        check(unsafe { sys::fp8_comm_create(&mut raw, ctx.as_ptr(), nranks, rank, &raw_id) })?;
        Ok(Comm { raw: created(raw, "fp8_comm_create")?, _ctx: PhantomData })
    }

    pub fn rank(&self) -> Result<i32> {
        let mut r = 0;
        check(unsafe { sys::fp8_comm_rank(self.raw.as_ptr(), &mut r) })?;
        Ok(r)
    }

    pub fn size(&self) -> Result<i32> {
        let mut s = 0;
        check(unsafe { sys::fp8_comm_size(self.raw.as_ptr(), &mut s) })?;
        Ok(s)
    }

    /// Makes every collective of this rank in flight or called later fail instead of waiting.
    /// (fp8.h lets another thread call this; this binding keeps a communicator on its rank's
    /// thread, as NCCL requires that no other thread be inside a call on this rank's models.)
    pub fn abort(&self) -> Result<()> {
        check(unsafe { sys::fp8_comm_abort(self.raw.as_ptr()) })
    }

    /// How long a wait for the group may last before the group is aborted (0: forever).
    pub fn set_timeout(&self, seconds: f64) -> Result<()> {
        check(unsafe { sys::fp8_comm_set_timeout(self.raw.as_ptr(), seconds) })
    }

    pub fn timeout(&self) -> Result<f64> {
        let mut s = 0.0;
        check(unsafe { sys::fp8_comm_get_timeout(self.raw.as_ptr(), &mut s) })?;
        Ok(s)
    }

    pub fn as_ptr(&self) -> *mut sys::fp8_comm_t {
        self.raw.as_ptr()
    }
}

impl Drop for Comm<'_> {
    fn drop(&mut self) {
        // The group is left when the models using it are gone too (libfp8 counts them).
        unsafe { sys::fp8_comm_destroy(self.raw.as_ptr()) }
    }
}

/// One rank of a group made inside this process (`fp8_comm_create_local`): its context and its
/// end of the group, to be moved to the rank's own thread. Everything made from the rank borrows
/// it (`rank.context()`), so the rank moves between threads only as a whole.
pub struct Rank {
    // Declared before `ctx`: dropped first.
    comm: Comm<'static>,
    ctx: Context,
    rank: i32,
}

// SAFETY: a Rank owns a context and the communicator made on it, nothing else refers to that
// context (objects made from it borrow the Rank, so the Rank cannot move while one exists), and
// fp8.h lets "different contexts be used from different threads at once": each rank's calls then
// come from its own thread, as fp8_comm_create_local intends. Not Sync: one thread at a time.
unsafe impl Send for Rank {}

impl Rank {
    /// Every rank of a group at once, rank k on `contexts[k]` (all CPU contexts, joined by
    /// libfp8's in-process transport, or CUDA contexts). All or nothing.
    pub fn local_group(contexts: Vec<Context>) -> Result<Vec<Rank>> {
        let n = i32::try_from(contexts.len()).map_err(|_| Error::new(Status::InvalidArgument, "too many ranks"))?;
        let ctxs: Vec<*mut sys::fp8_context_t> = contexts.iter().map(|c| c.as_ptr()).collect();
        let mut comms = vec![ptr::null_mut(); contexts.len()];
        check(unsafe { sys::fp8_comm_create_local(comms.as_mut_ptr(), ctxs.as_ptr(), n) })?;
        if comms.iter().any(|c| c.is_null()) {
            // fp8.h: all or nothing. Release what came, rather than trust half a group.
            comms.iter().for_each(|&c| unsafe { sys::fp8_comm_destroy(c) });
            return Err(Error::new(
                Status::Internal,
                "fp8_comm_create_local returned FP8_OK without every communicator",
            ));
        }
        contexts
            .into_iter()
            .zip(comms)
            .zip(0..n)
            .map(|((ctx, comm), rank)| {
                Ok(Rank { comm: Comm { raw: created(comm, "fp8_comm_create_local")?, _ctx: PhantomData }, ctx, rank })
            })
            .collect()
    }

    /// This rank's context: make its tensors and models from it.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// This rank's end of the group.
    pub fn comm(&self) -> &Comm<'_> {
        &self.comm
    }

    /// Its rank in the group (0-based).
    pub fn rank(&self) -> i32 {
        self.rank
    }
}
