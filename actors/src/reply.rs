//! A call's reply handle. The HTTP front sends a call's requests to the shop's
//! WorkManager with a [`Call`] and waits on one receiver; the WorkManager fills the call's
//! replies as they become known (at once for a repeat of a decided key, on the outcome
//! for the others) and the last one sends them all. So a call costs the front one wake-up,
//! not one for the admission and one per outcome, and no timer: the WorkManager, which
//! keeps the calls in deadline order, answers what is still open as [`Reply::Pending`]
//! at the deadline.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::oneshot;

use crate::ports::{LogAck, StoreError};
use crate::types::{Outcome, Request};

/// What one request of a call ends as.
#[derive(Debug, Clone)]
pub enum Reply {
    /// Its key was decided before it arrived: that outcome, nothing applied.
    Repeat(Arc<Outcome>),
    /// Decided while the caller waited (for a fire-and-forget repeat of a key in flight,
    /// the first submission's outcome).
    Decided(Arc<Outcome>),
    /// Fire-and-forget, taken in: owed a 202 if [`Answers::durable`] says so.
    Accepted,
    /// Still undecided at the call's deadline.
    Pending,
}

/// A call's replies, in the order of its requests.
#[derive(Debug)]
pub struct Answers {
    pub replies: Vec<Reply>,
    /// Whether the call's fire-and-forget requests are durable in the request log:
    /// `Ok(false)` if that was not known by the call's deadline, `Ok(true)` if it has
    /// none, `Err` if they cannot be made durable.
    pub durable: Result<bool, StoreError>,
}

pub type CallResult = Result<Answers, SubmitError>;

/// One call's reply handle, shared by the WorkManager's waiters of its requests.
pub struct Call {
    /// When the caller is owed an answer, outcome or not.
    pub deadline: Instant,
    /// Filled on the WorkManager's thread only; a mutex because the handle crosses
    /// threads inside a message (never contended).
    state: Mutex<CallState>,
}

struct CallState {
    replies: Vec<Option<Reply>>,
    /// Replies still missing, plus one until the WorkManager has taken the whole call
    /// in ([`Call::seal`]), plus one until the request log tells whether the call's
    /// fire-and-forget requests are durable ([`Call::log_ack`]): the call is never
    /// answered half admitted, and a 202 is answered with the acceptance's sync, not
    /// after it (one wake-up of the caller, not two).
    missing: usize,
    /// What the request log told of the call's fire-and-forget requests.
    logged: Logging,
    /// `None` once answered.
    tx: Option<oneshot::Sender<CallResult>>,
}

/// Where a call's fire-and-forget requests stand in the request log.
enum Logging {
    /// The call has none: [`Call::log_ack`] was not asked for.
    NoneAsked,
    /// Not told yet (answered at the deadline, not known durable).
    Waiting,
    Told(Result<(), StoreError>),
}

impl Call {
    /// A handle for `n` requests, and where its answer arrives.
    pub fn new(n: usize, deadline: Instant) -> (Arc<Call>, oneshot::Receiver<CallResult>) {
        let (tx, rx) = oneshot::channel();
        let call = Call {
            deadline,
            state: Mutex::new(CallState {
                replies: vec![None; n],
                missing: n + 1,
                logged: Logging::NoneAsked,
                tx: Some(tx),
            }),
        };
        (Arc::new(call), rx)
    }

    fn with(&self, f: impl FnOnce(&mut CallState)) {
        if let Ok(mut state) = self.state.lock() {
            f(&mut state);
            if state.missing == 0 {
                state.answer();
            }
        }
    }

    /// Sets request `index`'s reply, unless it has one (a call answered at its deadline
    /// keeps `Pending`).
    pub fn set(&self, index: usize, reply: Reply) {
        self.with(|s| {
            if let Some(slot @ None) = s.replies.get_mut(index) {
                *slot = Some(reply);
                s.missing -= 1;
            }
        });
    }

    /// The WorkManager has taken the whole call in.
    pub fn seal(&self) {
        self.with(|s| s.missing -= 1);
    }

    /// What the request log tells once the call's fire-and-forget requests are durable
    /// (asked for before [`Call::seal`]): the call is answered when that is told too, on
    /// the thread that tells it, or at its deadline.
    pub fn log_ack(self: &Arc<Self>) -> LogAck {
        if let Ok(mut s) = self.state.lock() {
            s.logged = Logging::Waiting;
            s.missing += 1;
        }
        let call = self.clone();
        LogAck::new(move |result| {
            call.with(|s| {
                if matches!(s.logged, Logging::Waiting) {
                    s.logged = Logging::Told(result);
                    // Zero already if the deadline answered the call.
                    s.missing = s.missing.saturating_sub(1);
                }
            })
        })
    }

    /// Nothing of the call was taken in.
    pub fn fail(&self, e: SubmitError) {
        if let Ok(mut s) = self.state.lock() {
            if let Some(tx) = s.tx.take() {
                let _ = tx.send(Err(e));
            }
        }
    }

    /// The deadline passed: what is still open is answered `Pending`.
    pub fn expire(&self) {
        self.with(|s| {
            for slot in s.replies.iter_mut().filter(|r| r.is_none()) {
                *slot = Some(Reply::Pending);
            }
            s.missing = 0;
        });
    }

    /// Answered, or its caller gone: nobody waits on it any more.
    pub fn is_done(&self) -> bool {
        self.state
            .lock()
            .map_or(true, |s| s.tx.as_ref().is_none_or(|tx| tx.is_closed()))
    }
}

impl CallState {
    fn answer(&mut self) {
        if let Some(tx) = self.tx.take() {
            let replies = std::mem::take(&mut self.replies)
                .into_iter()
                .map(|r| r.unwrap_or(Reply::Pending))
                .collect();
            let _ = tx.send(Ok(Answers {
                replies,
                durable: match std::mem::replace(&mut self.logged, Logging::NoneAsked) {
                    Logging::NoneAsked => Ok(true),
                    Logging::Waiting => Ok(false),
                    Logging::Told(told) => told.map(|()| true),
                },
            }));
        }
    }
}

/// Calls with requests still open, in deadline order (every call of a WorkManager has
/// the same reply timeout, so arrival order is deadline order). Answered calls leave
/// from the front, so it holds at most the calls of one reply timeout.
#[derive(Default)]
pub struct Deadlines(std::collections::VecDeque<Arc<Call>>);

impl Deadlines {
    pub fn push(&mut self, call: Arc<Call>) {
        while self.0.front().is_some_and(|c| c.is_done()) {
            self.0.pop_front();
        }
        if !call.is_done() {
            self.0.push_back(call);
        }
    }

    /// Answers the calls whose deadline has passed, and forgets the answered ones at the
    /// front.
    pub fn expire(&mut self, now: Instant) {
        while let Some(call) = self.0.front() {
            if call.deadline <= now {
                call.expire();
            } else if !call.is_done() {
                break;
            }
            self.0.pop_front();
        }
    }

    /// The deadline of the first call still open.
    pub fn first_deadline(&self) -> Option<Instant> {
        self.0.iter().find(|c| !c.is_done()).map(|c| c.deadline)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Gives back the room a burst of calls left (see `crate::shrink`).
    pub fn shrink(&mut self) {
        crate::shrink::queue(&mut self.0);
    }
}

/// Why a WorkManager did not take a call in (its reply handle gets this).
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("too many requests in flight")]
    Overloaded,
    /// This WorkManager has passivated: nothing of the call was taken in, and the engine
    /// sends it to the shop's new WorkManager.
    #[error("the shop's WorkManager passivated")]
    Passivated(Vec<Request>, Vec<bool>),
    #[error(transparent)]
    Store(StoreError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{now_ms, Entry, Op, Request};
    use std::time::Duration;

    fn outcome() -> Arc<Outcome> {
        let req = Request::new(
            "s".into(),
            "i".into(),
            "k".into(),
            Op::Decrement,
            1,
            now_ms(),
        );
        Arc::new(Entry::of_request(&req, now_ms()).outcome().expect("keyed"))
    }

    #[test]
    fn a_call_is_answered_once_sealed_and_every_reply_set() {
        let (call, mut rx) = Call::new(2, Instant::now() + Duration::from_secs(5));
        call.set(0, Reply::Repeat(outcome()));
        call.set(1, Reply::Decided(outcome()));
        assert!(
            rx.try_recv().is_err(),
            "answered before the WorkManager sealed it"
        );
        call.seal();
        let answers = rx.try_recv().expect("answered").expect("ok");
        assert!(matches!(answers.replies[0], Reply::Repeat(_)));
        assert!(matches!(answers.replies[1], Reply::Decided(_)));
    }

    #[test]
    fn an_expired_call_answers_what_is_open_as_pending_and_keeps_the_rest() {
        let start = Instant::now();
        let (call, mut rx) = Call::new(2, start + Duration::from_millis(10));
        call.set(0, Reply::Accepted);
        call.seal();
        let mut deadlines = Deadlines::default();
        deadlines.push(call.clone());
        deadlines.expire(start);
        assert!(rx.try_recv().is_err(), "expired before its deadline");
        deadlines.expire(start + Duration::from_millis(10));
        let answers = rx.try_recv().expect("answered").expect("ok");
        assert!(matches!(answers.replies[0], Reply::Accepted));
        assert!(matches!(answers.replies[1], Reply::Pending));
        assert!(deadlines.is_empty());
        // A reply after the deadline changes nothing.
        call.set(1, Reply::Decided(outcome()));
        assert!(call.is_done());
    }

    #[test]
    fn a_fire_and_forget_call_is_answered_when_the_log_tells_it_durable_not_before() {
        let (call, mut rx) = Call::new(1, Instant::now() + Duration::from_secs(5));
        let ack = call.log_ack();
        call.set(0, Reply::Accepted);
        call.seal();
        assert!(rx.try_recv().is_err(), "answered before the log told it");
        ack.done(Ok(()));
        let answers = rx.try_recv().expect("answered").expect("ok");
        assert!(matches!(answers.replies[0], Reply::Accepted));
        assert!(matches!(answers.durable, Ok(true)));

        // A failed write is told as it is; a log closed first (the ack dropped untold)
        // as closed.
        let (call, mut rx) = Call::new(1, Instant::now() + Duration::from_secs(5));
        let ack = call.log_ack();
        call.set(0, Reply::Accepted);
        call.seal();
        ack.done(Err(StoreError::DiskFull));
        let told = rx.try_recv().expect("answered").expect("ok").durable;
        assert!(matches!(told, Err(StoreError::DiskFull)), "{told:?}");
        let (call, mut rx) = Call::new(1, Instant::now() + Duration::from_secs(5));
        drop(call.log_ack());
        call.set(0, Reply::Accepted);
        call.seal();
        let told = rx.try_recv().expect("answered").expect("ok").durable;
        assert!(matches!(told, Err(StoreError::Closed)), "{told:?}");

        // Not told by the deadline: answered then, not known durable; told later,
        // nothing changes.
        let start = Instant::now();
        let (call, mut rx) = Call::new(1, start + Duration::from_millis(10));
        let ack = call.log_ack();
        call.set(0, Reply::Accepted);
        call.seal();
        let mut deadlines = Deadlines::default();
        deadlines.push(call.clone());
        deadlines.expire(start + Duration::from_millis(10));
        let answers = rx.try_recv().expect("answered").expect("ok");
        assert!(matches!(answers.durable, Ok(false)));
        ack.done(Ok(()));
        assert!(call.is_done());

        // A call of no fire-and-forget request asks for no ack: durable as it stands.
        let (call, mut rx) = Call::new(1, Instant::now() + Duration::from_secs(5));
        call.set(0, Reply::Decided(outcome()));
        call.seal();
        assert!(matches!(
            rx.try_recv().expect("answered").expect("ok").durable,
            Ok(true)
        ));
    }
}
