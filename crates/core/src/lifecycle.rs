//! The one lifecycle both kinds of upgrade share, as a pure state machine that the controller's shell
//! drives: reset, stop after the target is removed, a refused target decided once, a decided value that
//! stands, resume, start, the holds between kinds and their announcement, the write-ahead before every
//! call, what the calls' answers mean for the run, and when to look again.
//!
//! The machine does no IO. It asks for what it needs as a [`Step`] and is told what came of it:
//!
//! ```text
//!            ┌──────────────────────────── Lifecycle::start ───────────────────────────┐
//!            ▼                                                                          │
//!   Step::Look(Versions | Cluster) ──► looked(..) ──► Step::Further(..) ──► further(..) ─┤
//!                                                        (Talos: drain pass, installer   │
//!                                                         images, etcd again)            │
//!   Step::Act { run, actions, notes } ──► [shell: save run (write-ahead) ∥ publish notes,  │
//!                                          then the calls] ──► called(..) ─────────────────┤
//!   Step::Done(Conclusion) ◄─────────────────────────────────────────────────────────────┘
//!       [shell: keep the record, write the report, publish the rest, requeue]
//! ```
//!
//! What differs between Talos and Kubernetes is the [`Kind`] trait: the run record, the observation,
//! the actions, how a run starts and advances, and what an answered call means. Everything else is
//! written once, here, and tested table by table (`lifecycle/tests.rs`).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use jiff::Timestamp;

use crate::annotations::{self, UpgradeKind, UpgradeStatus};
use crate::catalog::Catalog;
use crate::crd::condition::Reason as ConditionReason;
use crate::gates::Gates;
use crate::holds::{Gate, HoldReason};
use crate::intent::{InvalidOption, Target, UpgradeIntent};
use crate::report::KindReport;
use crate::run::{
    NodeRole, Note, NoteType, Outcome, PreflightCheck, Reason, Record, Report, RunState,
};

/// What differs between the two kinds of upgrade, for the lifecycle they share.
pub trait Kind {
    const KIND: UpgradeKind;
    /// What `*-current`, `*-available` and the target are.
    type Version: Clone + fmt::Display + fmt::Debug + PartialEq;
    type Run: Record;
    /// The knobs of a run (the user's options, the controller's deadlines).
    type Settings: Clone + fmt::Debug;
    /// A full look at the cluster, what a decision is made on.
    type Observation: Clone + fmt::Debug + Default;
    /// What the versions alone show: `*-current`, `*-available`, and what a start is checked against.
    type Versions: Clone + fmt::Debug;
    type Action: Clone + fmt::Debug + PartialEq;
    /// What a full look must include beyond the nodes' state (Talos: which installer images to read).
    type Request: Clone + fmt::Debug + PartialEq;
    /// Work within a pass, before a decision: a further look, or (Talos) the drain pass the saved run
    /// already asks for.
    type Further: Clone + fmt::Debug + PartialEq;
    /// What a [`Kind::Further`] brought back.
    type FurtherLooked: fmt::Debug;

    /// The kind's target in the intent.
    fn target(intent: &UpgradeIntent) -> &Target<Self::Version>;
    /// The run's knobs; `Err` is an option that keeps any run from starting until it is fixed.
    fn settings(intent: &UpgradeIntent, limits: &Limits) -> Result<Self::Settings, InvalidOption>;
    /// The knobs to finish the work in flight with, starting nothing new (the target was removed).
    fn stopping(limits: &Limits) -> Self::Settings;
    /// What the full look must include for `run` (none yet: the run about to start).
    fn request(run: Option<&Self::Run>, settings: &Self::Settings) -> Self::Request;

    fn versions_of(observation: &Self::Observation) -> Self::Versions;
    /// `*-current`: the lowest version running, when known.
    fn current(versions: &Self::Versions) -> Option<Self::Version>;
    /// `*-available` from the release catalog; `None` when it cannot be told this time.
    fn available(versions: &Self::Versions, catalog: &Catalog) -> Option<Option<Self::Version>>;

    /// The version rules of a new run.
    fn check_start(versions: &Self::Versions, target: &Self::Version) -> StartCheck;
    /// Why `target` is not a release the catalog knows ([`Catalog::unknown`]).
    fn unknown(catalog: &Catalog, target: &Self::Version) -> Option<String>;
    /// Why a valid target cannot start yet: the other kind's run, or (Kubernetes) a node's Talos.
    fn hold_start(
        observation: &Self::Observation,
        target: &Self::Version,
        gates: &Gates,
    ) -> Option<Hold>;
    fn start(
        requested: &str,
        target: &Self::Version,
        settings: &Self::Settings,
        observation: &Self::Observation,
        now: Timestamp,
    ) -> Self::Run;
    /// The `UpgradeStarted` sentence.
    fn started(run: &Self::Run, versions: &Self::Versions, target: &Self::Version) -> String;
    /// The `Waiting:` sentence of a new run while no node tells its version.
    fn no_versions() -> &'static str;
    /// A failed run continues: what failed goes back to pending, what is done stays done.
    fn resume(run: &mut Self::Run, now: Timestamp);
    /// What `previous`, a run for another target, left that keeps a new run from starting, as seen
    /// now (Talos: a node with a new system installed for its next reboot, not rebooted since).
    fn left_pending(previous: &Self::Run, observation: &Self::Observation) -> Option<String>;
    /// What must outlive `run` when it is dropped (reset, target removed): the nodes it may have left
    /// with a new system installed for their next reboot, kept as a record that matches no target,
    /// so that a later run does not install over them (see [`Kind::left_pending`]).
    fn remember(run: &Self::Run, now: Timestamp) -> Option<Self::Run>;
    /// What a run stopped by a reset leaves on the nodes that the user must know of (Talos: a node
    /// left cordoned with a new system installed for its next reboot), one sentence each.
    fn left_behind(run: &Self::Run) -> Vec<String>;
    /// Whether the versions show a node below the target of this completed run: one that joined the
    /// cluster since, or one changed outside the controller. The cluster is then looked at in full.
    fn behind(run: &Self::Run, versions: &Self::Versions) -> bool;
    /// What the user can do about a node [`Kind::behind`] a completed run.
    fn behind_hint() -> &'static str;
    /// Whether the completed run left nodes out on purpose (Talos: held nodes), which its own
    /// message names: a node behind is then no change made outside the controller.
    fn left_out(_run: &Self::Run) -> bool {
        false
    }
    /// Whether a completed run takes in nodes that joined since ([`Kind::join`]); only then is a
    /// completed run with a node behind looked at in full.
    const JOINS: bool;
    /// Takes the nodes that joined the cluster since `run` completed, and are not on its target, into
    /// the run (pending: the run goes on), with an Event for each. Nodes of the run itself below the
    /// target are taken again only when the user asks (`again`: `resume`).
    fn join(
        run: &mut Self::Run,
        observation: &Self::Observation,
        again: bool,
        now: Timestamp,
    ) -> Vec<Note>;

    /// Work the pass does before deciding on `run` (nothing: decide at once).
    fn before_deciding(
        run: &Self::Run,
        settings: &Self::Settings,
        observation: &Self::Observation,
    ) -> Vec<Self::Further>;
    fn merge(observation: &mut Self::Observation, looked: Self::FurtherLooked);
    fn advance(
        run: &Self::Run,
        settings: &Self::Settings,
        observation: &Self::Observation,
        now: Timestamp,
    ) -> Decision<Self>;
    /// Records in `run` what an answered call means.
    fn answered(
        run: &mut Self::Run,
        action: &Self::Action,
        observation: &Self::Observation,
        now: Timestamp,
    ) -> Answered<Self::Further>;
    /// Records in `run` what an answered call that stored something means (the etcd snapshot: where
    /// it went, verified). A kind that makes no such call treats it as answered.
    fn stored(
        run: &mut Self::Run,
        action: &Self::Action,
        stored: &crate::etcd_snapshot::Stored,
        observation: &Self::Observation,
        now: Timestamp,
    ) -> Answered<Self::Further> {
        let _ = stored;
        Self::answered(run, action, observation, now)
    }
    /// Records that `action` never reached the node (it had no effect).
    fn not_reached(run: &mut Self::Run, action: &Self::Action);
    /// Records that `action` was refused for a reason that may pass, to be made again later; false
    /// when the run has no way to retry it (it is then refused for good).
    fn retry(run: &mut Self::Run, action: &Self::Action, reason: &str, now: Timestamp) -> bool;
    /// Records that `action` was refused for good: the run fails, naming the node. Returns the clean-up
    /// to do (Talos: uncordon a node the run cordoned).
    fn refused(
        run: &mut Self::Run,
        action: &Self::Action,
        reason: &str,
        now: Timestamp,
    ) -> Vec<Self::Action>;
    /// Whether the run's report is written before these calls, beside them: calls that can take
    /// minutes (a Talos install), during which `kubectl wait` should already show the node.
    fn reports_before(actions: &[Self::Action]) -> bool;
    /// Whether an answered `action` asks for a further look before the next decision (Talos: etcd
    /// leadership moved off the next control plane, so etcd is looked at again and the control plane
    /// upgraded in the same pass).
    fn looks_further(action: &Self::Action) -> bool;
    /// Nodes in flight in `before` and done in `after`, with how long each took (for the metrics).
    fn finished_nodes(before: &Self::Run, after: &Self::Run) -> Vec<(NodeRole, f64)>;

    /// The one-shot annotation asking to roll the last run back (Talos: `talos-rollback`); `None`:
    /// the kind has no rollback.
    fn rollback_key() -> Option<&'static str> {
        None
    }
    /// Whether the user asks for a rollback: `Err` is a value that cannot be read, as a sentence.
    fn rollback_asked(_intent: &UpgradeIntent) -> Option<Result<(), String>> {
        None
    }
    /// Starts the rollback the user asks for of `last`, a finished run, as a run of its own, with
    /// the sentence that announces it; `Err` is why it is refused (no node is touched).
    fn start_rollback(
        _last: &Self::Run,
        _intent: &UpgradeIntent,
        _settings: &Self::Settings,
        _observation: &Self::Observation,
        _now: Timestamp,
    ) -> Result<(Self::Run, String), String> {
        Err(format!("{} upgrades have no rollback", Self::KIND.name()))
    }
    /// The reason of the Event that announces `run`'s failure (Talos: a rollback's is its own).
    fn failed_reason(_run: &Self::Run) -> Reason {
        Reason::UpgradeFailed
    }
    /// Whether `resume` on this finished run starts the target afresh (Talos: a completed rollback,
    /// whose target stays decided until the user asks to upgrade again).
    fn resume_starts_afresh(_run: &Self::Run) -> bool {
        false
    }
}

/// The decision of one pass: the run to persist, then the calls to make, then what to tell the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision<K: Kind + ?Sized> {
    pub run: K::Run,
    pub actions: Vec<K::Action>,
    pub report: Report,
}

/// The version rules' answer for a new run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartCheck {
    /// The target may start.
    Go,
    /// No node tells its version yet: wait.
    NoVersions,
    /// The target is refused, with the rules' sentence.
    Refused(String),
}

/// A hold before a run starts, as the user sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hold {
    pub status: UpgradeStatus,
    pub condition: ConditionReason,
    pub message: String,
    /// The reason of the Event that announces the hold (once per message).
    pub reason: Reason,
    pub revisit: Revisit,
}

/// What an answered call means for the pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answered<F> {
    /// Nothing more: the effect is seen on a later look.
    Nothing,
    /// The call was the step's whole effect: decide again on the same look, so no pass is lost.
    DecideAgain,
    /// Look at something again, then decide again (Talos: etcd after leadership moved).
    LookFurther(F),
}

/// How a call went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Called {
    /// Answered: it did what it should.
    Done,
    /// Answered, and what it returned was stored and verified there (the etcd snapshot).
    Stored(crate::etcd_snapshot::Stored),
    /// Not reached: the call never got to the node, so it had no effect ([`Kind::not_reached`]
    /// records that it may be made again).
    NotReached(String),
    /// Sent, but its answer was lost: it may or may not have taken effect. What happens next is the
    /// run's rule (an unanswered upgrade call or reboot is repeated only once the node is seen not to
    /// have got it; an install is never made again before a reboot; a Kubernetes step is retried
    /// until its deadline, every call being idempotent).
    Unanswered(String),
    /// Refused this time for a reason that may pass (a registry that did not answer, an installer
    /// failure its exit code says is worth retrying): [`Kind::retry`] decides whether the run makes the
    /// call again later or fails as for [`Called::Refused`].
    Retry(String),
    /// Refused for good: the run fails with this reason.
    Refused(String),
}

/// When to look at the cluster again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Revisit {
    /// Nothing in flight: at the idle refresh.
    Idle,
    /// Work in flight or a hold: at the poll interval.
    Poll,
    /// The cluster could not be looked at: not sooner than a few seconds.
    AfterProblem,
    /// Blocked by the other kind or a node's Talos (Kubernetes): soon.
    Blocked,
    /// At once: etcd leadership just moved off the next control plane.
    Now,
    /// Every node in flight is only rebooting: its followers say when it is back, the poll is the
    /// safety net.
    AwaitingReboots,
    /// A gate holds the next node and nothing is in flight: at `until` when the hold ends by itself
    /// (a window's opening, a soak's end), otherwise (the canary) when the user changes something, or
    /// at the idle refresh. A cluster held for hours is not looked at every poll.
    Held { until: Option<Timestamp> },
    /// A gate that asks outside the cluster (alerts, health checks) holds: at the poll, but not more
    /// often than every 15 seconds.
    Checking,
}

/// The controller's deadlines, as the runs use them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// How long one node may take from its upgrade call (Talos ≥ 1.13: its reboot) to being done.
    pub node_deadline: Duration,
    /// How long draining a node before its reboot may take (Talos ≥ 1.13).
    pub drain_timeout: Duration,
    /// How long a node whose upgrade call got no answer must be seen on its old boot, ready, before
    /// the call is made again.
    pub unanswered_grace: Duration,
    /// How long after a call refused for a reason that may pass (see [`Called::Retry`]) it is made
    /// again; always within the node's deadline.
    pub retry_after: Duration,
    /// How long one step of a Kubernetes upgrade may take.
    pub step_deadline: Duration,
    /// The controller has somewhere to store etcd snapshots (`--etcd-snapshot-dir` or an S3 bucket):
    /// a cluster's runs take one unless its `etcd-snapshot` says off ([`crate::etcd_snapshot`]).
    pub etcd_snapshot: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            node_deadline: Duration::from_secs(15 * 60),
            drain_timeout: Duration::from_secs(5 * 60),
            unanswered_grace: Duration::from_secs(60),
            retry_after: Duration::from_secs(30),
            step_deadline: Duration::from_secs(10 * 60),
            etcd_snapshot: false,
        }
    }
}

/// What the lifecycle of one kind starts from in a reconcile.
pub struct Inputs<'a, K: Kind> {
    pub intent: &'a UpgradeIntent,
    /// The cluster's annotations as the reconcile sees them: the target as written, and what the
    /// controller last showed (a message already shown is not announced again).
    pub annotations: &'a BTreeMap<String, String>,
    /// The kind's persisted run, if any.
    pub record: Option<K::Run>,
    pub gates: Gates,
    pub limits: Limits,
    pub catalog: &'a Catalog,
    pub now: Timestamp,
}

/// What to look at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Look<R> {
    /// The versions only: a cluster with no run going (an idle refresh, a decided run).
    Versions,
    /// Everything a decision needs.
    Cluster(R),
}

/// What a look brought back; `Err` is why the cluster could not be looked at, as a sentence.
pub type Looked<T> = Result<T, String>;

/// What the shell does next.
#[derive(Debug)]
pub enum Step<K: Kind> {
    /// Look at the cluster, then [`Lifecycle::looked_at_versions`] or [`Lifecycle::looked_at_cluster`].
    Look(Look<K::Request>),
    /// Do these in order, then [`Lifecycle::further`] with what each brought back.
    Further(Vec<K::Further>),
    /// Save the run (the write-ahead), publish the notes, then make the calls in order (stopping at
    /// the first refused), then [`Lifecycle::called`].
    Act(Act<K>),
    /// Keep the record, write the report, publish the notes.
    Done(Conclusion<K>),
}

/// Calls to make once their run is saved.
#[derive(Debug, Clone, PartialEq)]
pub struct Act<K: Kind> {
    /// The run with every call about to be made recorded: saved before any call.
    pub run: K::Run,
    pub actions: Vec<K::Action>,
    /// Events announcing the calls, published with the save and before the calls: a controller
    /// that dies during the calls resumes from the saved run and would never tell them.
    pub notes: Vec<Note>,
    /// The report to write beside the calls ([`Kind::reports_before`]).
    pub report: Option<KindReport>,
}

/// How a kind's part of a reconcile ends.
#[derive(Debug, Clone, PartialEq)]
pub struct Conclusion<K: Kind> {
    /// The record to keep (`None`: none), saved if it differs from what is stored.
    pub record: Option<K::Run>,
    pub report: KindReport,
    /// Events still to publish.
    pub notes: Vec<Note>,
    /// Reasons of the Events already published in this pass (with the calls).
    pub announced: Vec<Reason>,
    /// Nodes found done in this pass, with how long each took.
    pub nodes_finished: Vec<(NodeRole, f64)>,
    /// When the run being shown started.
    pub run_started_at: Option<Timestamp>,
    /// A preflight check that started holding the run in this pass (counted once per hold).
    pub preflight_failure: Option<PreflightCheck>,
    /// The operator's gate holding the run's next node, if one does.
    pub gate: Option<GateHold>,
    pub revisit: Revisit,
}

/// The operator's gate holding a run's next node in a pass, as the shell counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateHold {
    pub gate: Gate,
    pub reason: HoldReason,
    /// The hold began (or its message changed) in this pass: counted once per hold.
    pub began: bool,
}

/// Where the machine is.
enum State<K: Kind> {
    Start,
    /// Waiting for the versions, to report a cluster with no run going.
    Versions(Idle<K>),
    /// Waiting for the full look.
    Cluster(Going<K>),
    /// Waiting for the further work before a decision.
    Preparing(Pass<K>),
    /// Waiting for the calls' answers.
    Acting(Pass<K>, Decision<K>),
    /// Waiting for the clean-up calls after a refused call, then concluding with this decision.
    CleaningUp(Pass<K>, Decision<K>),
    Done,
}

/// Why the versions are looked at.
enum Idle<K: Kind> {
    /// No target: the run (if any) is forgotten.
    Forget {
        reason: Option<ConditionReason>,
        message: Option<String>,
    },
    /// A finished run for this value: it stands (unless nodes joined since it completed).
    Stand {
        raw: String,
        target: K::Version,
        run: K::Run,
        settings: K::Settings,
    },
}

/// A target the full look is for.
struct Going<K: Kind> {
    /// `None`: the target was removed and the work in flight is being finished.
    target: Option<(String, K::Version)>,
    settings: K::Settings,
    /// The run for this target, if one was recorded.
    existing: Option<K::Run>,
    /// `existing` completed, and the versions show a node below its target: take in the nodes that
    /// joined since, if any, rather than resuming.
    reopen: bool,
    /// `existing` is finished and the user asks to roll it back: the look decides whether the
    /// rollback starts or is refused.
    rollback: bool,
}

/// One pass over a run, after the look.
struct Pass<K: Kind> {
    /// The run as the pass found it (resumed or started), for the nodes it finishes.
    before: K::Run,
    run: K::Run,
    settings: K::Settings,
    observation: K::Observation,
    versions: K::Versions,
    stopping: bool,
    /// etcd leadership (or the like) moved in this pass: look again and decide once more.
    looked_further: bool,
    /// The decision before a further look, concluded with if the next one does nothing new.
    previous: Option<Decision<K>>,
}

impl<K: Kind> Pass<K> {
    /// A fresh pass over `run`: nothing looked at further yet, no decision before it.
    fn new(
        run: K::Run,
        settings: K::Settings,
        observation: K::Observation,
        versions: K::Versions,
        stopping: bool,
    ) -> Self {
        Pass {
            before: run.clone(),
            run,
            settings,
            observation,
            versions,
            stopping,
            looked_further: false,
            previous: None,
        }
    }
}

/// The lifecycle of one kind in one reconcile.
pub struct Lifecycle<'a, K: Kind> {
    inputs: Inputs<'a, K>,
    /// One-shot annotations to remove.
    consumed: Vec<&'static str>,
    /// Events still to publish.
    notes: Vec<Note>,
    /// Reasons of Events published with the calls.
    announced: Vec<Reason>,
    /// An option made invalid while a run is under way: the run is followed as if paused, and this
    /// says why.
    held: Option<String>,
    /// The target was changed to this value while the saved run had nodes in flight, which are
    /// finished first.
    changed_to: Option<String>,
    state: State<K>,
}

impl<'a, K: Kind> Lifecycle<'a, K> {
    pub fn new(inputs: Inputs<'a, K>) -> Self {
        Lifecycle {
            inputs,
            consumed: Vec::new(),
            notes: Vec::new(),
            announced: Vec::new(),
            held: None,
            changed_to: None,
            state: State::Start,
        }
    }

    /// The first step.
    pub fn start(&mut self) -> Step<K> {
        assert!(
            matches!(self.state, State::Start),
            "the lifecycle starts once"
        );
        let kind = K::KIND;
        let intent = self.inputs.intent;
        if intent.reset(kind) {
            return self.reset();
        }
        let raw = self
            .inputs
            .annotations
            .get(kind.target_key())
            .map(|value| value.trim().to_string())
            .filter(|value| !value.is_empty());
        match (K::target(intent), raw) {
            (Target::Absent, _) | (_, None) => self.absent(),
            (Target::Invalid { .. } | Target::Version(_), Some(raw))
                if let Some(step) = self.changed_mid_run(&raw) =>
            {
                step
            }
            (Target::Invalid { reason, .. }, Some(raw)) => {
                // Nothing to resume while the value is not a version: the key is consumed, not left
                // behind to act on some later target.
                self.consume_resume();
                let message = format!(
                    "Invalid {}: {reason}. No node was touched.",
                    short_key(kind.target_key())
                );
                self.refuse(&raw, &message, None)
            }
            (Target::Version(target), Some(raw)) => {
                let target = target.clone();
                self.requested(raw, target)
            }
        }
    }

    /// The versions look asked for by [`Step::Look`]`(`[`Look::Versions`]`)`.
    pub fn looked_at_versions(&mut self, looked: Looked<K::Versions>) -> Step<K> {
        let State::Versions(idle) = std::mem::replace(&mut self.state, State::Done) else {
            panic!("versions looked at without being asked for");
        };
        let versions = looked.ok();
        match idle {
            Idle::Forget { reason, message } => self.forgotten(versions.as_ref(), reason, message),
            Idle::Stand {
                raw,
                target,
                run,
                settings,
            } => {
                if K::JOINS
                    && matches!(run.outcome(), Some(Outcome::Completed { .. }))
                    && versions.as_ref().is_some_and(|v| K::behind(&run, v))
                {
                    // Nodes below the target of a completed run: which, and whether they joined
                    // since, takes a full look.
                    let request = K::request(None, &settings);
                    self.state = State::Cluster(Going {
                        target: Some((raw, target)),
                        settings,
                        existing: Some(run),
                        reopen: true,
                        rollback: false,
                    });
                    return Step::Look(Look::Cluster(request));
                }
                self.stand(run, &settings, versions.as_ref())
            }
        }
    }

    /// The full look asked for by [`Step::Look`]`(`[`Look::Cluster`]`)`.
    pub fn looked_at_cluster(&mut self, looked: Looked<K::Observation>) -> Step<K> {
        let State::Cluster(going) = std::mem::replace(&mut self.state, State::Done) else {
            panic!("the cluster looked at without being asked for");
        };
        let observation = match looked {
            Ok(observation) => observation,
            // A completed run stands as it was shown; the next refresh looks again.
            Err(_) if going.reopen => {
                let run = going.existing.expect("a completed run to reopen");
                return self.stand(run, &going.settings, None);
            }
            Err(problem) => return self.cannot_proceed(&going, &problem),
        };
        let versions = K::versions_of(&observation);
        let Going {
            target,
            settings,
            existing,
            reopen,
            rollback,
        } = going;
        let Some((raw, target)) = target else {
            // Finishing the work in flight of a run whose target was removed.
            let run = existing.expect("a run in flight to finish");
            return self.prepare(Pass::new(run, settings, observation, versions, true));
        };
        if rollback {
            let last = existing.expect("a finished run to roll back");
            return self.roll_back(&last, &target, settings, observation, versions);
        }
        let run = match existing {
            Some(mut run) if reopen => {
                let again = self.inputs.intent.resume;
                let joined = K::join(&mut run, &observation, again, self.inputs.now);
                if joined.is_empty() {
                    return self.stand(run, &settings, Some(&versions));
                }
                self.consume_resume();
                self.notes.extend(joined);
                run
            }
            Some(mut run) if run.is_finished() => {
                K::resume(&mut run, self.inputs.now);
                self.consumed.push(annotations::RESUME);
                let what = if run.is_rollback() {
                    format!("rollback off {}", run.target())
                } else {
                    format!("upgrade to {}", run.target())
                };
                self.notes.push(Note::normal(
                    Reason::UpgradeResumed,
                    format!("Resuming the {} {what}", K::KIND.name()),
                ));
                run
            }
            // Nothing failed to resume: the key is consumed now, not left to resume a later
            // failure the user never saw.
            Some(run) => {
                self.consume_resume();
                run
            }
            None => {
                self.consume_resume();
                // A release newer than any the controller knows has no known rules: refused unless
                // the operator allows unknown releases.
                if let Some(why) = K::unknown(self.inputs.catalog, &target) {
                    let message = format!(
                        "{} upgrade refused: {why}. No node was touched.",
                        K::KIND.name()
                    );
                    return self.refuse(&raw, &message, Some(&versions));
                }
                match K::check_start(&versions, &target) {
                    StartCheck::Go => {}
                    StartCheck::NoVersions => {
                        let mut report = KindReport::new(
                            K::KIND,
                            UpgradeStatus::InProgress,
                            K::no_versions().to_string(),
                        );
                        report.condition_reason = Some(ConditionReason::InProgress);
                        return self.done(self.inputs.record.clone(), report, Revisit::Poll);
                    }
                    StartCheck::Refused(reason) => {
                        // The version rules' sentences may end in a full stop of their own.
                        let message = format!(
                            "{} upgrade refused: {}. No node was touched.",
                            K::KIND.name(),
                            reason.trim_end_matches('.')
                        );
                        return self.refuse(&raw, &message, Some(&versions));
                    }
                }
                // A run for another target that left a node with a new system installed for its
                // next reboot: a new run would install over it.
                let pending = self
                    .inputs
                    .record
                    .as_ref()
                    .filter(|previous| previous.requested() != raw)
                    .and_then(|previous| K::left_pending(previous, &observation));
                if let Some(why) = pending {
                    let hold = Hold {
                        status: UpgradeStatus::InProgress,
                        condition: ConditionReason::InProgress,
                        message: format!("Waiting: {why}"),
                        reason: Reason::UpgradeWaiting,
                        revisit: Revisit::Poll,
                    };
                    return self.hold(hold, &versions);
                }
                if let Some(hold) = K::hold_start(&observation, &target, &self.inputs.gates) {
                    return self.hold(hold, &versions);
                }
                let run = K::start(&raw, &target, &settings, &observation, self.inputs.now);
                self.notes.push(Note::normal(
                    Reason::UpgradeStarted,
                    K::started(&run, &versions, &target),
                ));
                run
            }
        };
        self.prepare(Pass::new(run, settings, observation, versions, false))
    }

    /// What the work asked for by [`Step::Further`] brought back, in order.
    pub fn further(&mut self, looked: Vec<K::FurtherLooked>) -> Step<K> {
        let State::Preparing(mut pass) = std::mem::replace(&mut self.state, State::Done) else {
            panic!("further work done without being asked for");
        };
        for result in looked {
            K::merge(&mut pass.observation, result);
        }
        self.decide(pass)
    }

    /// How the calls of [`Step::Act`] went, in order (shorter than the actions when the shell stopped
    /// at a refused call).
    pub fn called(&mut self, results: Vec<Called>) -> Step<K> {
        match std::mem::replace(&mut self.state, State::Done) {
            State::Acting(pass, decision) => self.settle(pass, decision, results),
            // Best effort: a clean-up that failed is made again while the node is in flight, and
            // otherwise left to the user, whom the failure message tells.
            State::CleaningUp(pass, failed) => self.conclude(pass, failed),
            _ => panic!("calls made without being asked for"),
        }
    }

    // ----- before any look -----

    fn reset(&mut self) -> Step<K> {
        let kind = K::KIND;
        let mut message = format!(
            "{} upgrade state was reset; no node was touched",
            kind.name()
        );
        // Touching no node, the reset cannot undo what the run left in flight: it says what.
        let left = self
            .inputs
            .record
            .as_ref()
            .map(K::left_behind)
            .unwrap_or_default();
        for sentence in left {
            message.push_str(". ");
            message.push_str(&sentence);
        }
        let mut report = KindReport::new(kind, UpgradeStatus::Idle, message);
        report.condition_reason = Some(ConditionReason::Reset);
        report.consumed = vec![kind.reset_key(), kind.target_key()];
        self.notes
            .push(Note::normal(Reason::UpgradeReset, report.message.clone()));
        let kept = self
            .inputs
            .record
            .as_ref()
            .and_then(|run| K::remember(run, self.inputs.now));
        self.done(kept, report, Revisit::Idle)
    }

    /// No target: the work in flight is finished, then the run is forgotten.
    fn absent(&mut self) -> Step<K> {
        if let Some(step) = self.finish_in_flight() {
            return step;
        }
        // A rollback needs the run recorded for the target: without one it is refused, not left
        // unread (the record stays until the annotation goes).
        if K::rollback_asked(self.inputs.intent).is_some() {
            let why = format!(
                "{} is not set, so there is no run to roll back (set it back to the value of the run \
                 to roll back)",
                short_key(K::KIND.target_key())
            );
            return self.refuse_rollback(&why, None);
        }
        self.forget(None)
    }

    /// The saved run's nodes in flight, finished before anything else (the target was removed or
    /// changed): `None` when it has none.
    fn finish_in_flight(&mut self) -> Option<Step<K>> {
        let in_flight = self
            .inputs
            .record
            .as_ref()
            .filter(|run| !run.is_finished() && !run.in_flight().is_empty());
        if let Some(run) = in_flight {
            let settings = K::stopping(&self.inputs.limits);
            let request = K::request(Some(run), &settings);
            self.state = State::Cluster(Going {
                target: None,
                settings,
                existing: Some(run.clone()),
                reopen: false,
                rollback: false,
            });
            return Some(Step::Look(Look::Cluster(request)));
        }
        None
    }

    /// A target other than the saved run's, while that run has nodes in flight: they are finished
    /// first (a node is never left half-upgraded, cordoned or with an install pending for its next
    /// reboot, nor installed again over it), then the new value is decided.
    fn changed_mid_run(&mut self, raw: &str) -> Option<Step<K>> {
        let changed = self
            .inputs
            .record
            .as_ref()
            .is_some_and(|run| run.requested() != raw);
        if !changed {
            return None;
        }
        let step = self.finish_in_flight()?;
        self.changed_to = Some(raw.to_string());
        Some(step)
    }

    /// Why the work in flight is being finished, for the messages.
    fn stopping_why(&self) -> String {
        match &self.changed_to {
            Some(raw) => format!("{} target changed to {raw}", K::KIND.name()),
            None => format!("{} target removed", K::KIND.name()),
        }
    }

    /// Forgets the run (if any) and reports the versions: from `versions` when the pass already
    /// looked, otherwise after a look at them.
    fn forget(&mut self, versions: Option<K::Versions>) -> Step<K> {
        let dropped = self.inputs.record.take();
        // What must outlive the run is kept (a node left with an install pending).
        self.inputs.record = dropped
            .as_ref()
            .and_then(|run| K::remember(run, self.inputs.now));
        let stopped = dropped.as_ref().is_some_and(|run| !run.is_finished());
        // Removing the target of a failed run is the documented way to clear the failure: the
        // condition must not go on saying `Failed` while the status is `idle` and the phase `Ready`.
        let cleared_failure = dropped.as_ref().is_some_and(|run| run.failure().is_some());
        let reason = (stopped || cleared_failure).then_some(ConditionReason::Reset);
        let message =
            stopped.then(|| format!("{} upgrade stopped: the target was removed", K::KIND.name()));
        if let Some(versions) = versions {
            return self.forgotten(Some(&versions), reason, message);
        }
        // While the other kind's run is under way, this kind's versions cannot change, and the
        // reconcile that ends that run refreshes them: the idle report already written stays.
        let shown = self.shown_message();
        if dropped.is_none()
            && self.inputs.gates.holds_idle_refresh(K::KIND)
            && self.shown_status() == Some(UpgradeStatus::Idle)
            && let Some(message) = shown
        {
            let report = KindReport::new(K::KIND, UpgradeStatus::Idle, message.to_string());
            return self.done(None, report, Revisit::Idle);
        }
        self.state = State::Versions(Idle::Forget { reason, message });
        Step::Look(Look::Versions)
    }

    fn forgotten(
        &mut self,
        versions: Option<&K::Versions>,
        reason: Option<ConditionReason>,
        message: Option<String>,
    ) -> Step<K> {
        let kind = K::KIND;
        let current = versions.and_then(K::current);
        let available = versions.and_then(|v| K::available(v, self.inputs.catalog));
        let message = message.unwrap_or_else(|| match (&current, &available) {
            (Some(version), Some(Some(next))) => format!("Upgrade available: {version} → {next}"),
            (Some(version), _) => {
                format!("{} {version} is running; no upgrade requested", kind.name())
            }
            (None, _) => format!("No {} upgrade requested", kind.name()),
        });
        let mut report = KindReport::new(kind, UpgradeStatus::Idle, message);
        report.current = current.map(|v| v.to_string());
        report.available = available.map(|v| v.map(|v| v.to_string()));
        report.condition_reason = reason;
        self.done(self.inputs.record.clone(), report, Revisit::Idle)
    }

    fn requested(&mut self, raw: String, target: K::Version) -> Step<K> {
        let intent = self.inputs.intent;
        // Bad options stop a run from starting until they are fixed.
        let settings = match K::settings(intent, &self.inputs.limits) {
            Ok(settings) => settings,
            Err(invalid) => {
                // A run under way is not dropped for it: its nodes in flight are followed to the end
                // (with their deadlines), as if paused, and nothing new starts until it is fixed.
                let running = self
                    .inputs
                    .record
                    .clone()
                    .filter(|run| run.requested() == raw && !run.is_finished());
                if let Some(run) = running {
                    self.held = Some(invalid.to_string());
                    let settings = K::stopping(&self.inputs.limits);
                    let request = K::request(Some(&run), &settings);
                    self.state = State::Cluster(Going {
                        target: Some((raw, target)),
                        settings,
                        existing: Some(run),
                        reopen: false,
                        rollback: false,
                    });
                    return Step::Look(Look::Cluster(request));
                }
                let message = format!("{} upgrade not started: {invalid}", K::KIND.name());
                self.note_once(NoteType::Warning, Reason::InvalidOption, &message);
                let mut report = KindReport::new(K::KIND, UpgradeStatus::Failed, message);
                report.condition_reason = Some(ConditionReason::Failed);
                return self.done(self.inputs.record.clone(), report, Revisit::Idle);
            }
        };
        let mut existing = self
            .inputs
            .record
            .clone()
            .filter(|run| run.requested() == raw);
        // `resume` on a target refused before any node was touched decides it again from scratch:
        // the cluster may have changed since, and a refusal that still holds is announced again,
        // since the user asked.
        if intent.resume
            && existing
                .as_ref()
                .is_some_and(|run| !run.touched() && run.failure().is_some())
        {
            existing = None;
            self.inputs.record = None;
        }
        // `resume` on a completed rollback: the user asks to upgrade again, so the target is decided
        // afresh.
        if intent.resume && existing.as_ref().is_some_and(K::resume_starts_afresh) {
            existing = None;
            self.inputs.record = None;
        }
        // A rollback of the finished run for this value: looked at in full, then started or refused.
        // While a run is under way it waits for its end; there is nothing to roll back without one.
        match K::rollback_asked(intent) {
            None => {}
            Some(Err(invalid)) => return self.refuse_rollback(&invalid, None),
            Some(Ok(())) => match &existing {
                Some(run) if run.is_finished() => {
                    let request = K::request(Some(run), &settings);
                    self.state = State::Cluster(Going {
                        target: Some((raw, target)),
                        settings,
                        existing,
                        reopen: false,
                        rollback: true,
                    });
                    return Step::Look(Look::Cluster(request));
                }
                Some(_) => {}
                None => {
                    let why = format!(
                        "there is no finished {} run for {} {raw} to roll back",
                        K::KIND.name(),
                        short_key(K::KIND.target_key())
                    );
                    return self.refuse_rollback(&why, None);
                }
            },
        }
        // A decision already made for this value stands, unless the user asks to resume a failed run.
        if let Some(run) = &existing
            && run.is_finished()
            && !(intent.resume && run.touched() && run.failure().is_some())
        {
            self.consume_resume();
            self.state = State::Versions(Idle::Stand {
                raw,
                target,
                run: run.clone(),
                settings,
            });
            return Step::Look(Look::Versions);
        }
        let request = K::request(existing.as_ref().filter(|r| !r.is_finished()), &settings);
        self.state = State::Cluster(Going {
            target: Some((raw, target)),
            settings,
            existing,
            reopen: false,
            rollback: false,
        });
        Step::Look(Look::Cluster(request))
    }

    /// A finished run for the target as written: reported as decided, with the versions as they are.
    fn stand(
        &mut self,
        run: K::Run,
        settings: &K::Settings,
        versions: Option<&K::Versions>,
    ) -> Step<K> {
        let decision = K::advance(&run, settings, &K::Observation::default(), self.inputs.now);
        let mut report = KindReport::of_decision(K::KIND, &decision.report);
        if !run.touched()
            && let Some(reason) = run.failure()
        {
            report.message = reason.to_string();
        }
        let current = versions.and_then(K::current);
        // A node of the run changed since it completed (rolled back or downgraded by hand): the
        // completion stands, but the message does not claim what the versions deny.
        if decision.report.state == RunState::Completed
            && let Some(versions) = versions
            && K::behind(&run, versions)
            && !K::left_out(&run)
            && let Some(current) = &current
        {
            report.message = format!(
                "{kind} upgrade to {target} completed, but a node runs {kind} {current} since \
                 (changed outside this controller; {hint})",
                kind = K::KIND.name(),
                target = run.target(),
                hint = K::behind_hint(),
            );
        }
        report.current = current.map(|v| v.to_string());
        report.available = versions
            .and_then(|v| K::available(v, self.inputs.catalog))
            .map(|v| v.map(|v| v.to_string()));
        // Only runs that touched nodes have a start worth showing; a refused target has none.
        let started = run.touched().then(|| run.started_at());
        let mut step = self.done(Some(run), report, Revisit::Idle);
        if let Step::Done(conclusion) = &mut step {
            conclusion.run_started_at = started;
        }
        step
    }

    /// A target refused before touching any node: recorded once, so it is not decided again until
    /// the annotation changes (or `resume`, or a reset).
    fn refuse(&mut self, raw: &str, message: &str, versions: Option<&K::Versions>) -> Step<K> {
        let already = self
            .inputs
            .record
            .as_ref()
            .is_some_and(|run| run.requested() == raw && run.failure().is_some());
        // A record that remembers what an earlier run left pending on the nodes is not replaced by a
        // refusal (which would forget it); the refusal is told once by its message instead.
        let remembers = self.inputs.record.as_ref().is_some_and(|run| {
            run.requested() != raw && K::remember(run, self.inputs.now).is_some()
        });
        if remembers {
            self.note_once(NoteType::Warning, Reason::InvalidTarget, message);
        } else if !already {
            self.inputs.record = Some(K::Run::refused(raw, message, self.inputs.now));
            self.notes
                .push(Note::warning(Reason::InvalidTarget, message.to_string()));
        }
        let recorded = self
            .inputs
            .record
            .as_ref()
            .and_then(|run| run.failure().map(str::to_string))
            .unwrap_or_else(|| message.to_string());
        self.refused(recorded, versions)
    }

    /// A rollback asked for (and not under way) that cannot start: the reason in the status and one
    /// Event per reason; the annotation stays until the user changes or removes it, and no node is
    /// touched. The record is kept as it was.
    fn refuse_rollback(&mut self, why: &str, versions: Option<&K::Versions>) -> Step<K> {
        let message = format!(
            "{} rollback refused: {}. No node was touched.",
            K::KIND.name(),
            why.trim_end_matches('.')
        );
        self.note_once(NoteType::Warning, Reason::RollbackRefused, &message);
        self.refused(message, versions)
    }

    /// Done, refused with `message` (status failed, no node touched): the record kept as it is,
    /// the versions running and the next available shown as for any finished run.
    fn refused(&mut self, message: String, versions: Option<&K::Versions>) -> Step<K> {
        let mut report = KindReport::new(K::KIND, UpgradeStatus::Failed, message);
        report.condition_reason = Some(ConditionReason::Failed);
        report.current = versions.and_then(K::current).map(|v| v.to_string());
        report.available = versions
            .and_then(|v| K::available(v, self.inputs.catalog))
            .map(|v| v.map(|v| v.to_string()));
        self.done(self.inputs.record.clone(), report, Revisit::Idle)
    }

    // ----- after the look -----

    /// The rollback of `last` the user asks for, on the full look: it starts as a run of its own
    /// (the annotation consumed, as `force-start` is once taken in), waits for the other kind's run
    /// like any start, or is refused.
    fn roll_back(
        &mut self,
        last: &K::Run,
        target: &K::Version,
        settings: K::Settings,
        observation: K::Observation,
        versions: K::Versions,
    ) -> Step<K> {
        if let Some(hold) = K::hold_start(&observation, target, &self.inputs.gates) {
            return self.hold(hold, &versions);
        }
        let started = K::start_rollback(
            last,
            self.inputs.intent,
            &settings,
            &observation,
            self.inputs.now,
        );
        match started {
            Ok((run, sentence)) => {
                self.consumed.extend(K::rollback_key());
                self.consume_resume();
                self.notes
                    .push(Note::normal(Reason::RollbackStarted, sentence));
                self.prepare(Pass::new(run, settings, observation, versions, false))
            }
            Err(why) => self.refuse_rollback(&why, Some(&versions)),
        }
    }

    fn cannot_proceed(&mut self, going: &Going<K>, problem: &str) -> Step<K> {
        let running = going.existing.as_ref().filter(|run| !run.is_finished());
        let (status, message, condition, revisit) = match (&going.target, running) {
            // The nodes in flight are not given up on: the run is kept until they are seen finished.
            (None, _) => (
                UpgradeStatus::InProgress,
                format!(
                    "{}: finishing the node(s) in flight before stopping ({problem})",
                    self.stopping_why()
                ),
                ConditionReason::InProgress,
                Revisit::Poll,
            ),
            (Some(_), Some(_)) => (
                UpgradeStatus::InProgress,
                format!("{} upgrade cannot proceed: {problem}", K::KIND.name()),
                ConditionReason::InProgress,
                Revisit::AfterProblem,
            ),
            (Some(_), None) => (
                UpgradeStatus::Failed,
                format!("{} upgrade cannot proceed: {problem}", K::KIND.name()),
                ConditionReason::Failed,
                Revisit::AfterProblem,
            ),
        };
        if going.target.is_some() {
            self.note_once(NoteType::Warning, Reason::UpgradeBlocked, &message);
        }
        let mut report = KindReport::new(K::KIND, status, message);
        report.condition_reason = Some(condition);
        // The run is held, not gone: what the annotations show of it stays.
        if let Some(run) = running {
            let (done, total) = run.counts();
            report.progress = (total > 0).then_some((done, total));
            report.in_flight = run.in_flight();
        }
        self.done(self.inputs.record.clone(), report, revisit)
    }

    fn hold(&mut self, hold: Hold, versions: &K::Versions) -> Step<K> {
        self.note_once(NoteType::Normal, hold.reason, &hold.message);
        let mut report = KindReport::new(K::KIND, hold.status, hold.message);
        report.condition_reason = Some(hold.condition);
        report.current = K::current(versions).map(|v| v.to_string());
        report.available =
            K::available(versions, self.inputs.catalog).map(|v| v.map(|v| v.to_string()));
        self.done(self.inputs.record.clone(), report, hold.revisit)
    }

    fn prepare(&mut self, pass: Pass<K>) -> Step<K> {
        let further = K::before_deciding(&pass.run, &pass.settings, &pass.observation);
        if further.is_empty() {
            return self.decide(pass);
        }
        self.state = State::Preparing(pass);
        Step::Further(further)
    }

    fn decide(&mut self, mut pass: Pass<K>) -> Step<K> {
        let mut decision = K::advance(
            &pass.run,
            &pass.settings,
            &pass.observation,
            self.inputs.now,
        );
        // After a further look, a decision is acted on only if it moves on (the control plane's
        // upgrade, not another leadership move); otherwise the pass ends with the decision before it,
        // and the cluster is looked at again at once.
        if let Some(previous) = pass.previous.take() {
            let moves_on = !decision.actions.is_empty()
                && !decision
                    .actions
                    .iter()
                    .any(|action| K::looks_further(action));
            if !moves_on {
                return self.conclude(pass, previous);
            }
            pass.looked_further = false;
        }
        if decision.actions.is_empty() {
            return self.conclude(pass, decision);
        }
        // The decision's Events go out with its calls, not again with the report.
        let mut notes = std::mem::take(&mut self.notes);
        notes.append(&mut decision.report.notes);
        self.announced.extend(notes.iter().map(|note| note.reason));
        let report = K::reports_before(&decision.actions).then(|| self.shown(&pass, &decision));
        let act = Act {
            run: decision.run.clone(),
            actions: decision.actions.clone(),
            notes,
            report,
        };
        self.state = State::Acting(pass, decision);
        Step::Act(act)
    }

    /// Records what the calls did, then goes on: a refused call fails the run (and cleans up), an
    /// answered one may call for another decision or look.
    fn settle(
        &mut self,
        mut pass: Pass<K>,
        mut decision: Decision<K>,
        results: Vec<Called>,
    ) -> Step<K> {
        let now = self.inputs.now;
        let mut run = decision.run.clone();
        let mut decide_again = false;
        let mut further = Vec::new();
        // Every call answered: the nodes it sent their upgrade (or reboot) wait for it now, as the
        // decision foresaw ([`crate::run::Report::awaiting_reboots_once_answered`]).
        if results.iter().all(|called| *called == Called::Done) {
            decision.report.awaiting_reboots |= decision.report.awaiting_reboots_once_answered;
        }
        let calls: Vec<(&K::Action, Called)> = decision.actions.iter().zip(results).collect();
        for (index, (action, called)) in calls.iter().cloned().enumerate() {
            match called {
                Called::Done => match K::answered(&mut run, action, &pass.observation, now) {
                    Answered::Nothing => {}
                    Answered::DecideAgain => decide_again = true,
                    Answered::LookFurther(look) => further.push(look),
                },
                Called::Stored(stored) => {
                    match K::stored(&mut run, action, &stored, &pass.observation, now) {
                        Answered::Nothing => {}
                        Answered::DecideAgain => decide_again = true,
                        Answered::LookFurther(look) => further.push(look),
                    }
                }
                Called::NotReached(_) => K::not_reached(&mut run, action),
                Called::Unanswered(_) => {}
                Called::Retry(reason) if K::retry(&mut run, action, &reason, now) => {}
                Called::Retry(reason) | Called::Refused(reason) => {
                    // Calls made at once with this one (a Talos pre-pull's) that were answered are
                    // recorded too, so that a `resume` does not make them again.
                    for (later, _) in calls[index + 1..]
                        .iter()
                        .filter(|(_, called)| *called == Called::Done)
                    {
                        K::answered(&mut run, later, &pass.observation, now);
                    }
                    let cleanup = K::refused(&mut run, action, &reason, now);
                    if run.failure().is_none() {
                        break;
                    }
                    // `advance` on a failed run announces nothing; this failure is new.
                    let mut failed = K::advance(&run, &pass.settings, &pass.observation, now);
                    failed.actions.clear();
                    failed.report.notes.push(Note::warning(
                        K::failed_reason(&run),
                        failed.report.message.clone(),
                    ));
                    pass.run = run.clone();
                    if cleanup.is_empty() {
                        return self.conclude(pass, failed);
                    }
                    let act = Act {
                        run,
                        actions: cleanup,
                        notes: Vec::new(),
                        report: None,
                    };
                    self.state = State::CleaningUp(pass, failed);
                    return Step::Act(act);
                }
            }
        }
        decision.run = run.clone();
        pass.run = run;
        if !further.is_empty() {
            pass.looked_further = true;
            pass.previous = Some(decision);
            self.state = State::Preparing(pass);
            return Step::Further(further);
        }
        if decide_again {
            return self.decide(pass);
        }
        self.conclude(pass, decision)
    }

    /// What the annotations show of a decision.
    fn shown(&self, pass: &Pass<K>, decision: &Decision<K>) -> KindReport {
        let mut report = KindReport::of_decision(K::KIND, &decision.report);
        if pass.stopping && !decision.report.in_flight.is_empty() {
            report.message = format!(
                "{}: finishing {} before stopping",
                self.stopping_why(),
                decision.report.in_flight.join(", ")
            );
            report.condition_reason = Some(ConditionReason::InProgress);
            report.status = UpgradeStatus::InProgress;
        }
        if let Some(invalid) = &self.held
            && matches!(
                decision.report.state,
                RunState::InProgress | RunState::Paused
            )
        {
            let (done, total) = (decision.report.done, decision.report.total);
            let what = if decision.report.in_flight.is_empty() {
                "no new node starts until it is fixed".to_string()
            } else {
                format!(
                    "finishing {} before holding",
                    decision.report.in_flight.join(", ")
                )
            };
            report.message = format!(
                "{} upgrade held: {invalid}; {what} ({done}/{total} done)",
                K::KIND.name()
            );
            report.condition_reason = Some(ConditionReason::InProgress);
            report.status = UpgradeStatus::InProgress;
        }
        // What the look saw, also when the run completes: a node outside the run (one that joined
        // meanwhile) may still run an older version.
        report.current = K::current(&pass.versions).map(|v| v.to_string());
        report.available =
            K::available(&pass.versions, self.inputs.catalog).map(|v| v.map(|v| v.to_string()));
        report.consumed = self.consumed.clone();
        for key in &decision.report.consumed {
            if !report.consumed.contains(key) {
                report.consumed.push(key);
            }
        }
        report
    }

    fn conclude(&mut self, pass: Pass<K>, decision: Decision<K>) -> Step<K> {
        // A run that failed while being finished is shown failed, like any other: its failure says
        // what it left on the nodes. The next pass forgets it (or decides the new target).
        let stopped = pass.stopping
            && decision.report.in_flight.is_empty()
            && decision.report.state != RunState::Failed;
        if stopped && let Some(raw) = self.changed_to.clone() {
            // The old run's nodes are done: it is forgotten, and the new value is decided at once.
            self.inputs.record = None;
            self.notes.extend(decision.report.notes);
            let mut report = KindReport::new(
                K::KIND,
                UpgradeStatus::InProgress,
                format!(
                    "{}: the node(s) in flight are done; deciding {raw}",
                    self.stopping_why()
                ),
            );
            report.condition_reason = Some(ConditionReason::InProgress);
            report.current = K::current(&pass.versions).map(|v| v.to_string());
            report.available =
                K::available(&pass.versions, self.inputs.catalog).map(|v| v.map(|v| v.to_string()));
            return self.done(None, report, Revisit::Now);
        }
        if stopped {
            // Nothing left in flight: the run is forgotten, and its last look gives the versions.
            self.inputs.record = Some(decision.run);
            self.notes.extend(decision.report.notes);
            return self.forget(Some(pass.versions));
        }
        let report = self.shown(&pass, &decision);
        if self.held.is_some() && report.message.contains(" upgrade held: ") {
            self.note_once(
                NoteType::Warning,
                Reason::InvalidOption,
                &report.message.clone(),
            );
        }
        let mut preflight_failure = None;
        let mut gate = None;
        if !pass.stopping {
            // A hold (preflight, etcd, pause) is announced once when it starts or changes, not on
            // every pass.
            // A gate's hold is announced the same way (the canary's is a pause, not a `Waiting:`).
            let hold_started = decision.actions.is_empty()
                && (report.message.starts_with("Waiting:") || decision.report.gate.is_some())
                && self.shown_message() != Some(report.message.as_str());
            if hold_started {
                self.notes
                    .push(Note::normal(Reason::UpgradeWaiting, report.message.clone()));
                preflight_failure = decision.report.hold.filter(|check| check.is_failure());
            }
            gate = decision.report.gate.as_ref().map(|hold| GateHold {
                gate: hold.gate,
                reason: hold.reason,
                began: hold_started,
            });
        }
        self.notes.extend(decision.report.notes.iter().cloned());
        let revisit = match decision.report.state {
            _ if pass.stopping => Revisit::Poll,
            // etcd leadership moved off the next control plane: upgrade it now, not a poll later.
            RunState::InProgress if pass.looked_further => Revisit::Now,
            RunState::InProgress if decision.report.awaiting_reboots => Revisit::AwaitingReboots,
            // A gate holds, and nothing is in flight (a hold is only reported then).
            RunState::InProgress | RunState::Paused if let Some(hold) = &decision.report.gate => {
                match hold.gate {
                    Gate::Alerts | Gate::HealthChecks => Revisit::Checking,
                    Gate::MaintenanceWindow | Gate::Soak | Gate::Canary => {
                        Revisit::Held { until: hold.until }
                    }
                }
            }
            RunState::InProgress | RunState::Paused => Revisit::Poll,
            RunState::Completed | RunState::Failed => Revisit::Idle,
        };
        let nodes_finished = K::finished_nodes(&pass.before, &decision.run);
        let started = decision.run.started_at();
        let mut step = self.done(Some(decision.run), report, revisit);
        if let Step::Done(conclusion) = &mut step {
            conclusion.nodes_finished = nodes_finished;
            conclusion.run_started_at = Some(started);
            conclusion.preflight_failure = preflight_failure;
            conclusion.gate = gate;
        }
        step
    }

    fn done(
        &mut self,
        record: Option<K::Run>,
        mut report: KindReport,
        revisit: Revisit,
    ) -> Step<K> {
        for key in &self.consumed {
            if !report.consumed.contains(key) {
                report.consumed.push(key);
            }
        }
        self.state = State::Done;
        Step::Done(Conclusion {
            record,
            report,
            notes: std::mem::take(&mut self.notes),
            announced: std::mem::take(&mut self.announced),
            nodes_finished: Vec::new(),
            run_started_at: None,
            preflight_failure: None,
            gate: None,
            revisit,
        })
    }

    // ----- helpers -----

    fn consume_resume(&mut self) {
        if self.inputs.intent.resume && !self.consumed.contains(&annotations::RESUME) {
            self.consumed.push(annotations::RESUME);
        }
    }

    fn shown_message(&self) -> Option<&str> {
        self.inputs
            .annotations
            .get(K::KIND.message_key())
            .map(String::as_str)
    }

    fn shown_status(&self) -> Option<UpgradeStatus> {
        self.inputs
            .annotations
            .get(K::KIND.status_key())
            .and_then(|status| UpgradeStatus::parse(status).ok())
    }

    /// An Event for `message`, unless the kind's message annotation already says it: a problem or
    /// hold that lasts many passes is told once, not once per pass.
    fn note_once(&mut self, type_: NoteType, reason: Reason, message: &str) {
        if self.shown_message() != Some(message) {
            self.notes.push(Note {
                type_,
                reason,
                message: message.to_string(),
            });
        }
    }
}

/// `talos-target` of `upgrade.vitistack.io/talos-target`.
fn short_key(key: &str) -> &str {
    key.strip_prefix(annotations::PREFIX).unwrap_or(key)
}

/// A flag annotation that is neither "true" nor "false" was given its safe reading (paused holds;
/// resume and the resets do nothing). The user is told by a Warning Event; the recorder folds the
/// repeats into one Event with a count.
pub fn invalid_flag_notes(intent: &UpgradeIntent) -> Vec<Note> {
    intent
        .invalid_flags
        .iter()
        .map(|invalid| {
            let reading = if invalid.key == annotations::PAUSED {
                "treated as paused until it is fixed"
            } else {
                "ignored until it is fixed"
            };
            Note::warning(Reason::InvalidFlag, format!("{invalid}; {reading}"))
        })
        .collect()
}

/// A kind with nothing of its own to do within a pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoFurther {}

#[cfg(test)]
mod tests;
