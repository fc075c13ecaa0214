//! Random sequences of top-ups and transfers over three customers, sent over
//! HTTP to the ledger example: after every operation the books balance, every
//! cached balance equals its entries, the customers' balances add up to what
//! was topped up, and each answer is the one a plain model predicts. Amounts
//! include the hostile ones: zero, negative, above the largest accepted, and
//! the ends of i64.

#[path = "../examples/ledger/app/mod.rs"]
#[allow(dead_code)]
mod app;
#[path = "../examples/ledger/testkit.rs"]
#[allow(dead_code)]
mod testkit;

use std::cell::RefCell;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use testkit::Ledger;

const EUR: &str = "EUR";
const USERS: usize = 3;
/// `examples/ledger/app/limits.rs`: the largest amount of one movement.
const MAX_AMOUNT: i64 = 1_000_000_000_000;

/// Mostly ordinary amounts; sometimes one the ledger must refuse.
fn amount(ordinary: std::ops::RangeInclusive<i64>) -> impl Strategy<Value = i64> {
    prop_oneof![
        8 => ordinary,
        1 => prop_oneof![
            Just(i64::MAX),
            Just(i64::MIN),
            Just(MAX_AMOUNT),
            Just(MAX_AMOUNT + 1),
            (MAX_AMOUNT + 1)..=i64::MAX,
            i64::MIN..=0,
        ],
    ]
}

#[derive(Debug, Clone)]
enum Op {
    TopUp { user: usize, amount: i64 },
    Transfer { from: usize, to: usize, amount: i64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..USERS, amount(1..=500)).prop_map(|(user, amount)| Op::TopUp { user, amount }),
        // Self-transfers, overdrafts and non-positive amounts included.
        (0..USERS, 0..USERS, amount(-20..=400)).prop_map(|(from, to, amount)| Op::Transfer {
            from,
            to,
            amount
        }),
    ]
}

/// What a correct ledger answers, from the balances alone.
fn expected_status(op: &Op, balances: &[i64; USERS]) -> u16 {
    match *op {
        Op::TopUp { amount, .. } | Op::Transfer { amount, .. } if amount <= 0 => 400,
        Op::TopUp { amount, .. } | Op::Transfer { amount, .. } if amount > MAX_AMOUNT => 422,
        Op::TopUp { .. } => 201,
        Op::Transfer { from, to, .. } if from == to => 422,
        Op::Transfer { from, amount, .. } if balances[from] < amount => 422,
        Op::Transfer { .. } => 201,
    }
}

async fn run_case(ledger: &mut Ledger, case: usize, ops: Vec<Op>) -> Result<(), TestCaseError> {
    // Fresh customers per case: the cases share one server and database.
    let mut users = [0; USERS];
    for user in &mut users {
        *user = ledger.client.open_account(EUR).await;
    }
    let mut model = [0i64; USERS];
    let mut topped_up = 0;
    for (i, op) in ops.iter().enumerate() {
        let key = format!("case-{case}-op-{i}");
        let expected = expected_status(op, &model);
        let reply = match *op {
            Op::TopUp { user, amount } => {
                ledger.client.top_up(&key, users[user], amount, EUR).await
            }
            Op::Transfer { from, to, amount } => {
                ledger
                    .client
                    .transfer(Some(&key), users[from], users[to], amount, EUR)
                    .await
            }
        };
        prop_assert_eq!(reply.status, expected, "{:?} answered {:?}", op, reply);
        if reply.status == 201 {
            match *op {
                Op::TopUp { user, amount } => {
                    model[user] += amount;
                    topped_up += amount;
                }
                Op::Transfer { from, to, amount } => {
                    model[from] -= amount;
                    model[to] += amount;
                }
            }
        }

        // Σ DEBIT == Σ CREDIT, every movement balanced, no cache drift.
        let books = app::admin::reconcile(&mut ledger.conn)
            .await
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(books.is_clean(), "after {:?}: {:?}", op, books);
        let mut total = 0;
        for (u, &account) in users.iter().enumerate() {
            let cached = ledger.balance(account).await;
            prop_assert_eq!(cached, ledger.entries_balance(account).await);
            prop_assert_eq!(cached, model[u], "user {} after {:?}", u, op);
            prop_assert!(cached >= 0);
            total += cached;
        }
        prop_assert_eq!(total, topped_up, "the balances add up to the top-ups");
    }
    Ok(())
}

#[test]
fn books_balance_after_every_operation() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let ledger = RefCell::new(runtime.block_on(Ledger::start()));
    let case = RefCell::new(0);
    let mut runner = TestRunner::new(Config {
        cases: 16,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&proptest::collection::vec(op(), 1..=20), |ops| {
            let n = {
                let mut case = case.borrow_mut();
                *case += 1;
                *case
            };
            runtime.block_on(run_case(&mut ledger.borrow_mut(), n, ops))
        })
        .unwrap();
}
