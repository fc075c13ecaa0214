#[derive(Debug, Clone, PartialEq, idem::States)]
#[states(Pending => Paid)]
enum OrderStatus<T> {
    Pending,
    Paid,
    #[allow(dead_code)]
    Other(std::marker::PhantomData<T>),
}

fn main() {}
